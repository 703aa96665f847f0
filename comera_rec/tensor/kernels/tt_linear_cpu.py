"""The fused CPU TT linear (``tt_linear_cpu.cpp``): its autograd function and when it applies.

``y = act((x @ left) @ right + bias)`` with ``left (N_in, r)`` and ``right (r, N_out)``
the merged chains of a TT weight, forward and backward each in one pass over the batch
in tiles of rows, the bias and the ReLU (and its mask) applied on the way: the BLAS path
(:class:`comera_rec.tensor.contract.TTLinearFunction`) makes six skinny GEMMs and passes
of their own for the bias, the ReLU and its backward, each over a ``(B, N)`` activation.
Built with the fused lookup, in one extension (see :mod:`.cpu_extension`), and switched on
and off with it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import torch

from comera_rec.tensor.kernels.compiled_ops import tt_chain_compiled, tt_chains_compiled, tt_linear_compiled
from comera_rec.tensor.kernels.cpu_extension import cpu_vector_bytes, extension
from comera_rec.tensor.kernels.ttm_cpu import cpu_float_tensors_apply, records_grad

_MAX_RANK_BYTES = 256  # the kernel keeps a row's rank vectors in registers: r <= 64 float32
_MAX_RANK_VECTORS = 8  # ... in at most 8 vectors (the widths the kernel is built for)
_EMPTY = torch.empty(0)


def max_fused_rank(dtype: torch.dtype) -> int:
    """The largest rank the fused CPU TT linear takes for ``dtype``: 64 for float32 and 32
    for float64 with 32- or 64-byte vectors (AVX2, AVX-512); 0 without the kernels."""
    width = cpu_vector_bytes()
    if width == 0:
        return 0
    return min(_MAX_RANK_BYTES, _MAX_RANK_VECTORS * width) // dtype.itemsize


def tt_linear_kernel_applies(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> bool:
    """Whether ``x @ left @ right`` is the fused CPU kernel's to do: real CPU float32 /
    float64 matrices of one dtype, ``r <=`` :func:`max_fused_rank`, outside tracing and
    ``torch.export`` (under ``torch.compile`` the kernel is an operator), kernel enabled."""
    return tt_linear_rank_applies(x, left.shape[1], left, right)


def tt_linear_rank_applies(x: torch.Tensor, rank: int, *operands: torch.Tensor) -> bool:
    """:func:`tt_linear_kernel_applies` before the chains are merged: ``x`` and the tensors
    they come from (``operands``) of one CPU float dtype, and the chains' ``rank`` within
    :func:`max_fused_rank`."""
    return cpu_float_tensors_apply(x, *operands, compiled=True) and 0 < rank <= max_fused_rank(x.dtype)


class _FusedTTLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, left, right, bias, relu):
        y, t = extension().tt_linear_forward(x, left, right, bias if bias is not None else _EMPTY.to(x.dtype), relu)
        ctx.save_for_backward(x, left, right, t, y if relu else _EMPTY.to(x.dtype))
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, left, right, t, y = ctx.saved_tensors
        need_bias = ctx.has_bias and bool(ctx.needs_input_grad[3])
        grad_x, grad_left, grad_right, grad_bias = extension().tt_linear_backward(
            grad_y, x, left, right, t, y, bool(ctx.needs_input_grad[0]), need_bias, bool(ctx.needs_input_grad[1])
        )
        return grad_x, grad_left, grad_right, grad_bias, None


def tt_linear_cpu(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    bias: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """``act((x @ left) @ right + bias)``, ``act`` the ReLU or none, by the fused kernel.

    The caller checks :func:`tt_linear_kernel_applies` first.

    Args:
        x: ``(B, N_in)``.
        left: ``(N_in, r)``, the merged input chain.
        right: ``(r, N_out)``, the merged output chain.
        bias: optional ``(N_out,)``.
        relu: apply the ReLU to the output (its mask is the output itself).

    Returns:
        ``(B, N_out)``.
    """
    if torch.compiler.is_compiling():
        return tt_linear_compiled(x, left, right, bias, relu)
    if not records_grad(x, left, right, bias):
        return extension().tt_linear_forward(
            x, left, right, bias if bias is not None else _EMPTY.to(x.dtype), bool(relu)
        )[0]
    return _FusedTTLinear.apply(x, left, right, bias, bool(relu))


def _chain_lists(x: torch.Tensor, operands: Sequence[torch.Tensor | None]) -> tuple[list, list, list]:
    """``(lefts, rights, biases)`` from ``left, right, bias`` of each layer in turn; an
    absent bias as the kernel's empty tensor."""
    biases = [b if b is not None else _EMPTY.to(x.dtype) for b in operands[2::3]]
    return list(operands[0::3]), list(operands[1::3]), biases


class _FusedTTChain(torch.autograd.Function):
    # operands: left, right, bias (or None) of each layer in turn
    @staticmethod
    def forward(ctx, x, relus, *operands):
        lefts, rights, biases = _chain_lists(x, operands)
        y, *ts = extension().tt_chain_forward(x, lefts, rights, biases, list(relus))
        ctx.relus = list(relus)
        ctx.has_bias = [b is not None for b in operands[2::3]]
        # the output is the last layer's ReLU mask (kept by the caller anyway, not recomputed)
        ctx.save_for_backward(x, *lefts, *rights, *biases, *ts, y if relus[-1] else _EMPTY.to(x.dtype))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        k = len(ctx.relus)
        saved = ctx.saved_tensors
        x, lefts, rights, biases, ts = (
            saved[0],
            saved[1 : 1 + k],
            saved[1 + k : 1 + 2 * k],
            saved[1 + 2 * k : 1 + 3 * k],
            saved[1 + 3 * k : 1 + 4 * k],
        )
        y = saved[-1]
        need = ctx.needs_input_grad  # (x, relus, left_0, right_0, bias_0, ...)
        need_left = [bool(need[2 + 3 * j]) for j in range(k)]
        need_bias = [ctx.has_bias[j] and bool(need[4 + 3 * j]) for j in range(k)]
        grad_x, *grads = extension().tt_chain_backward(
            grad_y,
            x,
            list(lefts),
            list(rights),
            list(biases),
            ctx.relus,
            list(ts),
            y,
            bool(need[0]),
            need_left,
            need_bias,
        )
        out: list[torch.Tensor | None] = [grad_x if need[0] else None, None]
        for j in range(k):
            grad_left, grad_right, grad_bias = grads[3 * j : 3 * j + 3]
            out += [
                grad_left if need_left[j] else None,
                grad_right if need[3 + 3 * j] else None,
                grad_bias if need_bias[j] else None,
            ]
        return tuple(out)


# the names torch.profiler gives the fused TT layers' forward calls while training (their
# autograd nodes: one layer, a chain of layers); each backward is the name + "Backward"
# (benchmarks read them)
PROFILER_NAMES = (_FusedTTLinear.__name__, _FusedTTChain.__name__)


_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_DEFAULT_L2_BYTES = 1 << 20  # where the host does not say (the smaller of the x86 hosts measured here)


@torch.compiler.assume_constant_result  # torch.compile takes its value: no trace of the file reads
def l2_cache_bytes() -> int:
    """One core's L2 cache in bytes, as Linux reports it; 1 MiB where it does not."""
    return _l2_cache_bytes()


@functools.lru_cache(maxsize=1)
def _l2_cache_bytes() -> int:
    try:
        for index in sorted(_CACHE_DIR.glob("index*")):
            if (index / "level").read_text().strip() == "2" and (index / "type").read_text().strip() != "Instruction":
                size = (index / "size").read_text().strip().upper()
                units = {"K": 1 << 10, "M": 1 << 20}
                return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (OSError, ValueError):
        pass
    return _DEFAULT_L2_BYTES


l2_cache_bytes.cache_clear = _l2_cache_bytes.cache_clear  # type: ignore[attr-defined]  # as an lru_cache


def chain_bytes(left: torch.Tensor, right: torch.Tensor) -> int:
    """What one layer of a chain keeps in cache for every block of rows: its weights and, in
    the backward, a partial of each weight gradient as large (``2 (N_in + N_out) r``
    values)."""
    return 2 * (left.numel() + right.numel()) * left.element_size()


def chain_fits(layers_bytes: int) -> bool:
    """Whether layers holding ``layers_bytes`` (:func:`chain_bytes` summed) gain by a chain:
    within half of one core's L2, leaving the rest to the block's activations. Beyond it,
    every block of rows reads the weights and partials from farther out, as much traffic as
    the chain saves: MLPerf's 1024-wide top MLP in one chain was no faster than its layers
    one by one (0.98x at 2048 rows), the Kaggle MLPs (0.25-0.42 MB) 1.04-1.09x faster."""
    return layers_bytes <= l2_cache_bytes() // 2


def tt_chain_kernel_applies(x: torch.Tensor, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether a chain of layers ``(left, right)`` on ``x`` is the fused CPU chain's to do:
    :func:`tt_linear_kernel_applies` for each layer, each layer's input the output of the one
    before."""
    width = x.shape[-1] if x.dim() == 2 else -1
    for left, right in layers:
        if (
            left.dim() != 2
            or right.dim() != 2
            or left.shape[0] != width
            or not tt_linear_kernel_applies(x, left, right)
        ):
            return False
        width = right.shape[1]
    return bool(layers)


def tt_chain_cpu(
    x: torch.Tensor,
    layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]],
) -> torch.Tensor:
    """Consecutive fused TT linears ``h = act_k((h @ left_k) @ right_k + bias_k)`` in one
    kernel call each way, a block of rows at a time through every layer (see
    ``tt_chain_forward`` in ``tt_linear_cpu.cpp``). The same values as :func:`tt_linear_cpu`
    layer after layer, without writing the hidden outputs to memory: the backward recomputes
    them from each layer's ``x @ left`` (``(B, r)``, kept).

    The caller checks :func:`tt_chain_kernel_applies` first.

    Args:
        x: ``(B, N_0)``.
        layers: per layer ``(left (N_k, r_k), right (r_k, N_{k+1}), bias (N_{k+1},) or None,
            relu)``.

    Returns:
        ``(B, N_K)``.

    Example::

        >>> x = torch.randn(4, 8)
        >>> a, b = (torch.randn(8, 2), torch.randn(2, 6), None, True), (torch.randn(6, 3), torch.randn(3, 5), None, False)
        >>> torch.allclose(tt_chain_cpu(x, [a, b]), tt_linear_cpu(tt_linear_cpu(x, *a), *b))  # doctest: +SKIP
        True
    """
    if torch.compiler.is_compiling():
        return tt_chain_compiled(x, layers)
    operands: list[torch.Tensor | None] = []
    for left, right, bias, _ in layers:
        operands += [left, right, bias]
    relus = tuple(bool(layer[3]) for layer in layers)
    if not records_grad(x, *operands):
        return extension().tt_chain_forward(x, *_chain_lists(x, operands), list(relus))[0]
    return _FusedTTChain.apply(x, relus, *operands)


def tt_linear_pack(
    left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """``left``, ``right`` and ``bias`` padded and packed as the fused forward reads them, once,
    for a caller that scores many batches with the same weights (a forward packs them on
    every call: at a few rows, most of its time). Hand the result to
    :func:`tt_linear_cpu_packed`; it is valid while these tensors do not change.

    Args:
        left: ``(N_in, r)``, the merged input chain.
        right: ``(r, N_out)``, the merged output chain.
        bias: optional ``(N_out,)``.

    Returns:
        The packed operands (opaque: four tensors).
    """
    return tuple(extension().tt_linear_pack(left, right, bias if bias is not None else _EMPTY.to(left.dtype)))


def tt_linear_cpu_packed(
    x: torch.Tensor, packed: Sequence[torch.Tensor], rank: int, out_features: int, relu: bool = False
) -> torch.Tensor:
    """:func:`tt_linear_cpu` without gradients, on operands from :func:`tt_linear_pack`.

    The caller checks :func:`tt_linear_kernel_applies` for ``x`` and the chains the operands
    were packed from, and that no gradient is wanted.

    Args:
        x: ``(B, N_in)``.
        packed: :func:`tt_linear_pack` of ``(left, right, bias)``.
        rank: ``r``, the chains' rank.
        out_features: ``N_out``.
        relu: apply the ReLU to the output.

    Returns:
        ``(B, N_out)``, equal to ``tt_linear_cpu(x, left, right, bias, relu)``.
    """
    return extension().tt_linear_forward_packed(x, list(packed), rank, out_features, bool(relu))


# Rows a thread of the cross kernel takes through every layer at a time: two tiles of 12
# (AVX2) or three of 8 (AVX-512). The block's input and running activation then stay in its
# core's cache between layers. At MLPerf's width (3456), 3 layers at rank 32, 4096 rows on
# the 2-core AVX2 host: 24-row blocks 107.7 ms (one thread) / 58.5 ms (two), 144-row blocks
# 121.9 / 69.5 ms, the whole batch as one block 132.0 ms (one thread).
CROSS_BLOCK_ROWS = 24


def tt_cross_cpu(
    x0: torch.Tensor | Sequence[torch.Tensor],
    layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    block_rows: int | None = None,
    next_layers: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]] = (),
) -> torch.Tensor:
    """A DCN cross net for scoring: ``x_{k+1} = x_k + x0 * ((x_k @ left_k) @ right_k +
    bias_k)`` from ``x_0 = x0``, each layer's two projections merged into one TT weight, in
    one call of the fused kernel (no gradient).

    Each thread takes blocks of ``block_rows`` rows through every layer, so each ``(B, N)``
    activation is read from memory once and written once instead of once per layer, and
    each layer's bias and residual are applied while a tile's rows are in registers. The
    caller checks :func:`tt_linear_kernel_applies` for every layer first.

    Args:
        x0: ``(B, N)``, the cross net's input; or its column blocks ``(B, N_p)`` in order
            (``N = sum N_p``), as ``torch.cat(x0, dim=1)`` would join them: each thread
            copies its rows of them into one block, and the joined ``(B, N)`` input is
            never made (DCN's input is the dense features, then the pooled embeddings).
        layers: ``(left (N, r_k), right (r_k, N), bias (N,) or None)`` per layer.
        block_rows: rows a thread takes through every layer at a time
            (:data:`CROSS_BLOCK_ROWS` by default).
        next_layers: TT linears ``(left (N_in, r), right (r, N_out), bias (N_out,) or None,
            relu)`` that take the net's output one after the other, block by block while it
            is in cache (a DCN's top MLP's TT layers): the last one's output is returned,
            and neither the net's ``(B, N)`` output nor the layers' own are written to
            memory.

    Returns:
        ``(B, N)``, or the last next layer's ``(B, N_out)``; a new tensor.

    Raises:
        RuntimeError: gradients would be needed, no layers, or shapes that do not fit
            (named).

    Example::

        >>> x0 = torch.randn(4, 16)
        >>> left, right = torch.randn(16, 2), torch.randn(2, 16)
        >>> want = x0 + x0 * (x0 @ left @ right)
        >>> torch.allclose(tt_cross_cpu(x0, [(left, right, None)]), want, atol=1e-5)
        True
        >>> torch.allclose(tt_cross_cpu([x0[:, :6], x0[:, 6:]], [(left, right, None)]), want, atol=1e-5)
        True
        >>> top_left, top_right = torch.randn(16, 3), torch.randn(3, 5)
        >>> y = tt_cross_cpu(x0, [(left, right, None)], next_layers=[(top_left, top_right, None, True)])
        >>> torch.allclose(y, torch.relu(want @ top_left @ top_right), atol=1e-4)
        True
    """
    parts = [x0] if isinstance(x0, torch.Tensor) else list(x0)
    weights = [t for layer in layers for t in layer] + [t for *layer, _ in next_layers for t in layer]
    if records_grad(*parts, *weights):
        raise RuntimeError("tt_cross_cpu: scoring only; with gradients call the layers one by one")
    if block_rows is None:
        block_rows = CROSS_BLOCK_ROWS
    empty = _EMPTY.to(parts[0].dtype) if parts else _EMPTY
    return extension().tt_cross_forward(
        parts,
        [left for left, _, _ in layers],
        [right for _, right, _ in layers],
        [bias if bias is not None else empty for _, _, bias in layers],
        int(block_rows),
        [left for left, *_ in next_layers],
        [right for _, right, *_ in next_layers],
        [bias if bias is not None else empty for _, _, bias, _ in next_layers],
        [bool(relu) for *_, relu in next_layers],
    )


def tt_chains_kernel_applies(cores: Sequence[torch.Tensor], controllers: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`tt_chains_cpu` may merge these: real CPU float32 / float64 tensors of
    one dtype, outside tracing and ``torch.export`` (under ``torch.compile`` the kernel is
    an operator), kernels enabled."""
    return cpu_float_tensors_apply(*cores, *controllers, compiled=True)


class _TTChains(torch.autograd.Function):
    @staticmethod
    def forward(ctx, num_input_cores, in_features, out_features, *tensors):
        cores, controllers = list(tensors[: 2 * num_input_cores]), list(tensors[2 * num_input_cores :])
        left, right, *saved = extension().tt_chains_forward(
            cores, controllers, num_input_cores, in_features, out_features
        )
        ctx.num_input_cores = num_input_cores
        ctx.save_for_backward(*tensors, *saved)
        return left, right

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_left, grad_right):
        d = ctx.num_input_cores
        tensors = ctx.saved_tensors
        cores, controllers, saved = tensors[: 2 * d], tensors[2 * d : 4 * d - 1], tensors[4 * d - 1 :]
        left_shape = (saved[2 * (d - 1) + 1].shape[0], saved[2 * (d - 1) + 1].shape[1])
        if grad_left is None:
            grad_left = cores[0].new_zeros(left_shape)
        if grad_right is None:
            grad_right = cores[0].new_zeros((cores[d].shape[0], 1))
        grads = extension().tt_chains_backward(
            grad_left.contiguous(), grad_right.contiguous(), list(cores), list(controllers), list(saved), d
        )
        return (None, None, None, *grads)


def tt_chains_cpu(
    input_cores: Sequence[torch.Tensor],
    output_cores: Sequence[torch.Tensor],
    controllers: Sequence[torch.Tensor],
    in_features: int,
    out_features: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A TT weight's two chains, ``left (in_features, r)`` and ``right (r, out_features)``,
    from its cores and bond controllers in one C++ call each way.

    The same products as :func:`comera_rec.tensor.contract.merge_input_chain` /
    ``merge_output_chain`` of the controller-scaled cores (each controller scales its side's
    running product instead of a core), without the ~50 small autograd operators of that
    composition. The caller checks :func:`tt_chains_kernel_applies` first.

    Args:
        input_cores: the ``d`` input-side cores ``(r_{k-1}, n_k, r_k)``, ``r_0 = 1``.
        output_cores: the ``d`` output-side cores, the last with ``r = 1``.
        controllers: the ``2d - 1`` bond controllers ``(r_k,)``, in bond order.
        in_features: rows of ``left`` kept (``<= n_1 ... n_d``).
        out_features: columns of ``right`` kept.

    Returns:
        ``(left, right)``.
    """
    d = len(input_cores)
    if len(output_cores) != d:
        raise ValueError(f"tt_chains_cpu: {d} input cores and {len(output_cores)} output cores (need as many)")
    if torch.compiler.is_compiling():
        return tt_chains_compiled([*input_cores, *output_cores], controllers, d, in_features, out_features)
    return _TTChains.apply(d, in_features, out_features, *input_cores, *output_cores, *controllers)
