"""The fused CPU TTM lookup (``ttm_cpu.cpp``): the lookup's autograd function and the checks
that say when a CPU kernel applies; built with the other CPU kernels of this package (one
extension, :mod:`.cpu_extension`, whose names are importable from here too).

The kernel keeps both levels of de-duplication of the PyTorch path but needs no sort
and forms nothing of a table's size: every id's prefix and suffix key is given a slot
through a direct-address array over the (small) key space of each half, each distinct
prefix and suffix is contracted once, and one pass per bag contracts prefix x suffix
and pools. The backward sends each row's gradient into its two slots, then the slots'
gradients into the core slices, every write owned by one thread (no atomics).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from comera_rec.tensor.bags import divide_bags
from comera_rec.tensor.derived import DerivedCaches, cache_applies, derived_cache, scoring_cache_on
from comera_rec.tensor.halves import split_point
from comera_rec.tensor.halves import whole_halves_bytes as halves_bytes

# re-exported: the build of the CPU kernels, importable from here as before it had a module of its own
from comera_rec.tensor.kernels.build_support import (  # noqa: F401
    KernelBuild,
    build_root,
    disabled_by_env,
    exclusive_build,
    pinned_ninja_on_path,
)
from comera_rec.tensor.kernels.cpu_extension import (  # noqa: F401
    BUILD_TIME,
    DISABLE_ENV,
    KERNELS_DIR,
    VECTOR_BYTES_ENV,
    CpuExtension,
    build_cpu_kernels,
    cpu_kernel_enabled,
    cpu_kernels_switched_on,
    cpu_vector_bytes,
    extension,
    host_description,
    register_cpu_extension,
    registered_cpu_extensions,
    set_cpu_kernel_enabled,
)


def cpu_float_operands(*tensors: torch.Tensor, compiled: bool = False) -> bool:
    """Whether these are operands a CPU kernel may take: real CPU float32 / float64 tensors
    of one dtype, outside tracing and ``torch.compile`` (whether the kernel is built and
    on is the caller's check). ``compiled``: the kernel is an operator a graph of
    ``torch.compile`` may call (:mod:`.compiled_ops`), so it may take them while compiling
    too (not while exporting: a saved program would need this package's operators)."""
    dtype = tensors[0].dtype if tensors else None
    if dtype not in (torch.float32, torch.float64) or torch.jit.is_tracing():
        return False
    if torch.compiler.is_compiling() and (not compiled or torch.compiler.is_exporting()):
        return False
    # is_cpu: no device object made per tensor (scoring asks this for every layer and lookup)
    return all(t.is_cpu and t.dtype == dtype for t in tensors)


def autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (it then picks the GEMMs' dtype)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # an older torch, or a device type autocast does not know
        return torch.is_autocast_enabled() if device_type == "cuda" else False


_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def float32_under_cpu_autocast(x: object) -> object:
    """``x`` in float32 where it is a CPU tensor that ``torch.autocast("cpu")`` made
    bfloat16 or float16; anything else as it is.

    The fused CPU kernels compute in float32. Under CPU autocast they take their inputs
    back to float32, as autocast's own float32 operators do, rather than leave the layer to
    PyTorch's operators in the lower precision: on the Kaggle DLRM at rank 32 that path made
    the step 0.85x as fast (docs/performance-history.md, 2026-12-05).

    Args:
        x: a module's input (not a tensor: returned as it is, for the module to reject).

    Example::

        >>> h = torch.ones(2, 3, dtype=torch.bfloat16)
        >>> float32_under_cpu_autocast(h).dtype
        torch.bfloat16
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     float32_under_cpu_autocast(h).dtype
        torch.float32
    """
    if type(x) is torch.Tensor and x.dtype in _AUTOCAST_DTYPES and x.is_cpu and autocast_enabled("cpu"):
        return x.float()
    return x


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op on these: gradients on and one of them needs a
    gradient. When it would not (scoring), a kernel is called without its autograd
    function, whose ``apply`` costs as much as a one-row batch's arithmetic."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def cpu_float_tensors_apply(*tensors: torch.Tensor, compiled: bool = False) -> bool:
    """Whether the tensor core's CPU kernels may take these operands: real CPU float32 /
    float64 tensors of one dtype, outside tracing and ``torch.compile`` (inside it too for
    a kernel that is an operator there: ``compiled``, see :func:`cpu_float_operands`),
    kernels enabled (each kernel's ``*_applies`` adds its own shape limits)."""
    return cpu_float_operands(*tensors, compiled=compiled) and cpu_kernel_enabled()


def cpu_kernel_applies(cores: Sequence[torch.Tensor], ids: torch.Tensor) -> bool:
    """Whether a lookup is the fused CPU kernel's to do: real CPU float32 / float64
    tensors of 2 to 4 cores, outside tracing and ``torch.compile``, kernel enabled."""
    return 2 <= len(cores) <= 4 and ids.device.type == "cpu" and cpu_float_tensors_apply(*cores)


EMPTY = torch.empty(0, dtype=torch.long)  # an absent optional tensor argument (``.to(dtype)`` for floats)
_EMPTY_FLOAT = torch.empty(0)  # no output given to write into


def _kernel_forward(cores, ids, trains, offsets, weights, dim, batch, middle, into, stream_cols) -> list[torch.Tensor]:
    """The kernel's forward (``ttm_bag_forward``): the bags, then what its backward reads;
    with ``into`` (a ``(batch, C)`` tensor) the bags written there at ``stream_cols``."""
    return extension().ttm_bag_forward(
        list(cores),
        ids,
        trains,
        offsets,
        weights,
        int(dim),
        int(batch),
        _forward_layouts(cores),
        middle,
        into if into is not None else _EMPTY_FLOAT,
        int(into.shape[1]) if into is not None else 0,
        [int(c) for c in stream_cols],
    )


class _FusedTTMBag(torch.autograd.Function):
    """``(ids, offsets, trains, weights, dim, batch, middle, into, stream_cols, *cores) -> (B,
    dim)`` summed bags, or ``(batch, B / batch * dim)`` with ``batch > 0`` (bag ``f * batch +
    b`` in row ``b``); ``middle``: the middle bond's controller ``(T, r)`` not folded into the
    cores, or empty. With ``into`` (a ``(batch, C)`` tensor, ``batch > 0``) the bags are
    written into it in place, stream ``f``'s at columns ``stream_cols[f] ...``, and ``into``
    is the output: its other columns keep their values, and its gradient passes on whole to
    whatever wrote them."""

    @staticmethod
    def forward(ctx, ids, offsets, trains, weights, dim, batch, middle, into, stream_cols, *cores):
        out, pslot, sslot, pkeys, skeys, ptab, stab = _kernel_forward(
            cores, ids, trains, offsets, weights, dim, batch, middle, into, stream_cols
        )
        ctx.save_for_backward(offsets, weights, middle, pslot, sslot, pkeys, skeys, ptab, stab, *cores)
        # row_stride 0: the kernel's own layout, no output given
        ctx.layout = (dim, batch, into.shape[1] if into is not None else 0, list(stream_cols))
        if into is not None:
            ctx.mark_dirty(into)
            return into
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        offsets, weights, middle, pslot, sslot, pkeys, skeys, ptab, stab, *cores = ctx.saved_tensors
        weights_need_grad = bool(ctx.needs_input_grad[3]) and weights.numel() > 0
        dim, batch, row_stride, stream_cols = ctx.layout
        *grad_cores, grad_weights, grad_middle = extension().ttm_bag_backward(
            grad_out,
            cores,
            offsets,
            weights,
            pslot,
            sslot,
            pkeys,
            skeys,
            ptab,
            stab,
            weights_need_grad,
            dim,
            batch,
            middle,
            row_stride,
            stream_cols,
        )
        middle_need_grad = bool(ctx.needs_input_grad[6]) and middle.numel() > 0
        return (
            None,
            None,
            None,
            grad_weights if weights_need_grad else None,
            None,
            None,
            grad_middle if middle_need_grad else None,
            grad_out if row_stride else None,  # the other columns' writers read theirs from it
            None,
            *grad_cores,
        )


# the names torch.profiler gives the fused lookup's forward and backward (benchmarks read them)
PROFILER_NAMES = (_FusedTTMBag.__name__, f"{_FusedTTMBag.__name__}Backward")

# the scopes torch.profiler shows inside them (ttm_cpu.cpp's ProfiledPhases), each with its
# kind of work: "contraction" (products of core slices, whose FLOPs shrink with the rank),
# "per id" (per id or distinct row: random reads of rows, bound by memory latency) or
# "pass" (a pass over cores or slots: bound by memory bandwidth); a phase that did not run
# is absent from a profile
PHASE_KINDS = {
    "ttm_lookup: core layouts": "pass",
    "ttm_lookup: keys and slots": "per id",
    "ttm_lookup: contractions": "contraction",
    "ttm_lookup: controller": "pass",
    "ttm_lookup: pooling": "per id",
    "ttm_lookup backward: grouping": "per id",
    "ttm_lookup backward: row gradients": "per id",
    "ttm_lookup backward: slot gradients": "per id",
    "ttm_lookup backward: controller": "pass",
    "ttm_lookup backward: core layouts": "pass",
    "ttm_lookup backward: core gradients": "contraction",
}


def take_contraction_flops() -> int:
    """FLOPs (two per multiply-add) of the fused CPU lookup's contraction phases (its
    ``"contraction"`` phases in ``PHASE_KINDS``: products of core slices, at the true rank)
    counted over all its forward and backward calls since the last call, which restarts the
    count; 0 without the compiled kernels. For benchmarks that set those phases' time against
    their FLOPs."""
    ext = extension()
    return 2 * ext.take_contraction_madds() if ext is not None else 0


# the permuted, padded core copies a lookup makes, kept for the stacks of cores
# looked up without gradients (scoring calls every group's lookup with the same cores)
_LAYOUTS = DerivedCaches(slots=64, max_bytes=256 << 20)


def _forward_layouts(cores: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``[]`` (the kernel makes them) or the kept layouts of these unchanged cores."""
    kept = _LAYOUTS.get_when(cores, lambda: _own_layouts(cores), lambda: cache_applies(cores))
    if kept is None:
        return []
    left1, right0 = kept
    # a layout that is the core itself (nothing to pad) is not kept: a kept value must not
    # hold its sources alive
    return [cores[1] if left1 is None else left1, right0]


# both halves of a stack contracted over all their row indices, kept while scoring: a
# model's every stack, up to 1 GiB in all (least recently used out)
_HALVES = DerivedCaches(slots=64, max_bytes=1 << 30)

WHOLE_HALVES_MAX_BYTES = 256 << 20
"""The most bytes a stack's two whole halves may take to be kept for scoring
(:func:`_whole_halves`); a larger stack contracts its distinct prefixes and suffixes per batch."""


def whole_halves_bytes(cores: Sequence[torch.Tensor]) -> int:
    """Bytes of a stack's two halves contracted over all their row indices: ``T (N_l M_l +
    N_r M_r) r_pad`` values, ``r_pad`` the middle rank padded to whole vectors."""
    return halves_bytes(cores, rank_multiple=max(1, cpu_vector_bytes() // cores[0].element_size()))


def _whole_halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept ``(P, S)`` halves of these unchanged cores when scoring (inside
    :func:`~comera_rec.tensor.cached_weights`, gradients off) and they take at most
    :data:`WHOLE_HALVES_MAX_BYTES`; else ``None``.

    Made once, they turn each batch's lookup into two row reads and one small product per
    id: at a batch of 4096 rows the Kaggle model's 4-core stack contracts ~6,000 distinct
    prefixes and ~7,000 suffixes per batch, each as many multiply-adds as 8 ids' pooling.
    """
    # the kernel makes the core layouts it needs for this once and drops them (not kept)
    return _HALVES.get_when(
        cores,
        lambda: tuple(extension().ttm_halves(list(cores))),
        lambda: cache_applies(cores) and whole_halves_bytes(cores) <= WHOLE_HALVES_MAX_BYTES,
    )


def make_whole_halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both halves of a stack contracted over all their row indices, in the layout
    :func:`ttm_embedding_bag_cpu` reads them (its ``halves`` argument): ``(prefixes, suffixes)``,
    ``whole_halves_bytes(cores)`` bytes. For a caller that keeps them itself."""
    return tuple(extension().ttm_halves(list(cores)))


def kept_whole_halves(
    module: torch.nn.Module,
    sources: Sequence[torch.Tensor],
    cores: Sequence[torch.Tensor],
    ids: torch.Tensor,
    folded: Callable[[], Sequence[torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A TTM module's whole halves while it scores on CPU (inside
    :func:`~comera_rec.tensor.cached_weights`, gradients off, within
    :data:`WHOLE_HALVES_MAX_BYTES`), kept on ``module`` keyed on its own parameters; else
    ``None``. Only the halves are kept, not the controller-folded cores they are made from
    (those would add the stack's size again for nothing).

    Args:
        module: the module that keeps them (its ``"whole_halves"`` derived cache).
        sources: the parameters the halves come from (cores, then controllers).
        cores: the cores in stacked form ``(T, r, n, m, r')`` (read for their shapes).
        ids: the batch's ids (the halves serve CPU lookups only).
        folded: makes the controller-folded cores in stacked form, when the halves are made.
    """
    if not scoring_cache_on() or ids.device.type != "cpu":
        return None
    return derived_cache(module, "whole_halves").get_when(
        sources,
        lambda: make_whole_halves(folded()),
        lambda: (
            cache_applies(sources)
            and cpu_kernel_applies(cores, ids)
            and whole_halves_bytes(cores) <= WHOLE_HALVES_MAX_BYTES
        ),
    )


def _own_layouts(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
    left1, right0 = extension().ttm_forward_layouts(list(cores))
    same = left1.numel() > 0 and left1.data_ptr() == cores[1].data_ptr()
    return (None if same else left1), right0


class _GatherBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, col, width, *sources):
        ctx.map = (src, col, width, [s.shape[1] for s in sources])
        return extension().gather_blocks(list(sources), src, col, width)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        src, col, width, widths = ctx.map
        return (None, None, None, *extension().scatter_blocks(grad, widths, src, col, width))


def check_jagged(
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor | None,
    batch: int,
    bounds: Sequence[int],
) -> tuple[int, int, int, int]:
    """Check a key-major jagged batch in one pass (CPU tensors, the kernels built; the caller checks).

    Args:
        values: the ids, keys one after the other.
        lengths: ``(keys * batch,)`` bag lengths.
        offsets: ``(keys * batch + 1,)`` or ``None``.
        batch: bags per key.
        bounds: per key, ids must lie in ``[0, bound)``; a negative bound leaves the key unchecked.

    Returns:
        ``(code, position, sum of lengths, key)``: code 0 all good, 1 a negative length at
        bag ``position``, 2 offsets that disagree with the lengths at bag ``position``, 3 an
        id out of its key's range at ``position`` of ``values``.
    """
    empty = EMPTY if offsets is None else offsets
    code, pos, total, key = extension().check_jagged(values, lengths, empty, int(batch), list(bounds))
    return int(code), int(pos), int(total), int(key)


def gather_column_blocks(
    sources: Sequence[torch.Tensor], blocks: Sequence[tuple[int, int]], width: int
) -> torch.Tensor:
    """Column blocks of several ``(B, C_s)`` matrices side by side, in one pass over the rows.

    ``torch.cat([sources[s][:, c : c + width] for s, c in blocks], dim=1)`` with a backward
    that writes each source's gradient once (the blocks must not overlap). CPU float
    tensors with the fused kernel built (:func:`cpu_kernel_enabled`); the caller checks.

    Args:
        sources: ``(B, C_s)`` matrices, one ``B``.
        blocks: ``(source, first column)`` of every output block, in output order.
        width: columns per block.

    Returns:
        ``(B, len(blocks) * width)``.
    """
    src = [int(s) for s, _ in blocks]
    col = [int(c) for _, c in blocks]
    if not records_grad(*sources):
        return extension().gather_blocks(list(sources), src, col, int(width))
    return _GatherBlocks.apply(src, col, int(width), *sources)


def ttm_embedding_bag_cpu(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
    *,
    stream_batch: int = 0,
    halves: tuple[torch.Tensor, torch.Tensor] | None = None,
    middle: torch.Tensor | None = None,
    into: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> torch.Tensor:
    """The fused CPU lookup with the signature of ``contract.ttm_embedding_bag``.

    The caller checks :func:`cpu_kernel_applies` first. Ids out of the TT row shape's
    range, or table indices out of the stack, raise an error naming the value.
    ``halves``: these cores' :func:`make_whole_halves`, kept by the caller (scoring, no
    gradients): the lookup reads them and nothing else of the cores but their shapes.
    ``middle``: the controller ``(T, r)`` of the bond between the two halves, left out of
    ``cores``: the kernel scales the distinct prefixes by it (and works out its gradient
    from theirs), where folding it into a core would cost passes over that whole core.
    ``into``: ``(out, stream_cols)``, with ``stream_batch > 0``, sum pooling and no kept
    halves: the bags are written into the ``(stream_batch, C)`` tensor ``out`` in place,
    stream ``f``'s at columns ``stream_cols[f] ...`` (a caller that lays several lookups'
    bags side by side, with no gather after), and ``out`` is returned; in training its
    gradient passes on whole to the op that made ``out`` (each writer reads its columns).

    Returns:
        ``(B, embedding_dim)`` pooled embeddings, or with ``stream_batch > 0`` the bags
        as ``(stream_batch, B / stream_batch * embedding_dim)`` (stream ``f``'s bags in
        columns ``f * embedding_dim ...``), written so by the kernel; with ``into``, its ``out``.
    """
    cores = list(cores)
    shape = tuple(int(c.shape[2]) for c in cores)
    if tuple(int(n) for n in row_shape) != shape:
        raise ValueError(f"ttm_embedding_bag: row_shape {tuple(row_shape)} does not match the cores' {shape}")
    weights = per_sample_weights if per_sample_weights is not None else EMPTY.to(cores[0].dtype)
    batch = int(stream_batch)
    trains = trains if trains is not None else EMPTY
    if middle is not None and halves is not None:
        raise ValueError("ttm_embedding_bag_cpu: kept halves are made from folded cores; pass no middle controller")
    if into is not None and (halves is not None or mode != "sum" or batch <= 0):
        raise ValueError("ttm_embedding_bag_cpu: into= needs stream_batch > 0, sum pooling and no kept halves")
    if halves is None and middle is None and into is None:
        halves = _whole_halves(cores)
    middle_arg = middle if middle is not None else EMPTY.to(cores[0].dtype)
    target, stream_cols = into if into is not None else (None, ())
    if halves is not None:  # scoring: two rows of the kept halves per id, nothing contracted
        prefixes, suffixes = halves
        suffix_rows = math.prod(int(n) for n in row_shape[split_point(len(cores)) :])
        out = extension().ttm_bag_forward_halves(
            prefixes,
            suffixes,
            ids,
            trains,
            offsets,
            weights,
            int(embedding_dim),
            batch,
            int(cores[0].shape[0]),
            suffix_rows,
        )
    elif not records_grad(weights, middle, target, *cores):
        out = _kernel_forward(
            cores, ids, trains, offsets, weights, embedding_dim, batch, middle_arg, target, stream_cols
        )[0]
    else:
        cols = tuple(int(c) for c in stream_cols)
        out = _FusedTTMBag.apply(
            ids, offsets, trains, weights, int(embedding_dim), batch, middle_arg, target, cols, *cores
        )
    # out: (B, D), or (batch, streams * D)
    if mode == "mean":
        out = divide_bags(out, (offsets[1:] - offsets[:-1]).clamp_min(1), batch)
    return out
