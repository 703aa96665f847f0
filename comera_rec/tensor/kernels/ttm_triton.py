"""Fused Triton TTM lookup: gather + contract + pool in one kernel, and its backward.

The de-duplicated torch code of :mod:`comera_rec.tensor.halves` still builds the two
halves of the train: one prefix ``(M_l, r)`` per distinct ``(train, i_1..i_h)`` and one
suffix ``(r, M_r)`` per distinct ``(train, i_{h+1}..i_d)``. The kernels take over from
there, so that no ``(U, D)`` row matrix and no per-id intermediate is ever written:

* forward (one program per bag and column block): for each id of the bag, the row
  ``prefix[p(id)] @ suffix[s(id)]`` is contracted in registers over the middle rank,
  scaled by the per-sample weight and added to the bag's accumulator; mean pooling
  divides by the bag length (empty bags give zeros);
* backward into the halves: the ids are sorted by prefix key (resp. suffix key) and cut
  into work items of at most ``chunk`` ids of one key; a program sums
  ``c_i * g[bag(i)] @ suffix[s(i)]^T`` (resp. ``c_i * prefix[p(i)]^T @ g[bag(i)]``) over
  its item in registers and adds the sum into the key's gradient with one atomic add.
  Keys with at most ``chunk`` ids get exactly one add (no contention); a hot key gets
  ``ceil(count / chunk)``;
* backward into the per-sample weights (when they need it): one program per id, the
  dot product of its row with its bag's output gradient.

From the halves' gradients the ordinary autograd graph of the half contraction carries
the gradient into the cores. Neither direction forms the table.

The launchers work on any tensors the Triton runtime accepts: CUDA tensors, or CPU tensors
under the interpreter (``TRITON_INTERPRET=1`` set before the first launch in the process),
which is how the tests run them. Kernels are jitted lazily, on first launch, once per
interpreter setting.

This module holds the autograd function and the entry points; the kernel bodies are in
:mod:`.ttm_triton_kernels`, their launchers and the backward's work items in
:mod:`.ttm_triton_launch`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from comera_rec.tensor.derived import DerivedCaches, cache_applies
from comera_rec.tensor.halves import half, half_keys, split_point, whole_halves, whole_halves_bytes
from comera_rec.tensor.kernels.ttm_triton_launch import (
    launch_backward_halves,
    launch_backward_weights,
    launch_forward,
)

POOLING_MODES = ("sum", "mean")
DEFAULT_CHUNK = 64  # ids per backward work item
DEFAULT_BLOCK_ELEMS = 2048  # bound on a program's 2-D tile (elements)


SCORING_HALVES_MAX_BYTES = 256 << 20
"""The most bytes a stack's two whole halves may take to be kept for scoring
(:func:`scoring_halves`); a larger stack's lookups contract the halves per batch."""

# both whole halves of each stack, kept while scoring (see scoring_halves): a model's every
# stack, up to 1 GiB in all (a model with more scores by evicting the least recently used)
_SCORING_HALVES = DerivedCaches(slots=64, max_bytes=1 << 30)


def _own_whole_halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # a kept value must not hold its sources alive: a one-core half can be a view of its core
    prefix, suffix = whole_halves(cores)
    shared = {c.untyped_storage().data_ptr() for c in cores}
    return tuple(t.clone() if t.untyped_storage().data_ptr() in shared else t for t in (prefix, suffix))


def scoring_halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept whole halves of these unchanged cores when scoring (inside
    :func:`~comera_rec.tensor.cached_weights`, gradients off, not in a CUDA graph capture)
    and they take at most :data:`SCORING_HALVES_MAX_BYTES`; else ``None``.

    Kept, they make a scoring lookup one kernel launch and a few index operations, with no
    ``torch.unique`` and no host synchronisation (the de-duplicated path waits on the host
    to size its work).
    """
    return _SCORING_HALVES.get_when(
        cores,
        lambda: _own_whole_halves(cores),
        lambda: cache_applies(cores) and whole_halves_bytes(cores) <= SCORING_HALVES_MAX_BYTES,
    )


class TTMBagFunction(torch.autograd.Function):
    """Pooled bags of ``prefix[p] @ suffix[s]`` rows, with the fused kernels both ways.

    Saves only the halves and the index tensors; the backward returns gradients for
    ``prefix``, ``suffix`` and the per-sample weights (each only when needed). With
    ``static`` the backward's work items come from :func:`~comera_rec.tensor.kernels.ttm_triton_launch.segments_static`.
    """

    @staticmethod
    def forward(
        ctx,
        prefix: torch.Tensor,
        suffix: torch.Tensor,
        p_of_id: torch.Tensor,
        s_of_id: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        mean: bool,
        dim: int,
        chunk: int,
        block_elems: int,
        static: bool = False,
    ) -> torch.Tensor:
        ctx.save_for_backward(prefix, suffix, p_of_id, s_of_id, offsets, weights)
        ctx.mean, ctx.chunk, ctx.block_elems, ctx.static = mean, chunk, block_elems, static
        return launch_forward(prefix, suffix, p_of_id, s_of_id, offsets, weights, mean, dim, block_elems)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        prefix, suffix, p_of_id, s_of_id, offsets, weights = ctx.saved_tensors
        need_p, need_s, _, _, _, need_w = ctx.needs_input_grad[:6]
        grad_out = grad_out.contiguous()  # (B, D)
        n = p_of_id.numel()
        lengths = offsets[1:] - offsets[:-1]  # (B,)
        bag_of_id = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=n
        )  # (N,)
        if ctx.mean:
            scale = (1.0 / lengths.clamp_min(1).to(torch.float64)).to(prefix.dtype)[bag_of_id]  # (N,)
        else:
            scale = torch.ones(n, device=prefix.device, dtype=prefix.dtype)
        coef = scale * weights.to(scale.dtype) if weights is not None else scale  # (N,)
        grad_p, grad_s = launch_backward_halves(
            grad_out,
            prefix,
            suffix,
            p_of_id,
            s_of_id,
            bag_of_id,
            coef.contiguous(),
            need_p,
            need_s,
            ctx.chunk,
            ctx.block_elems,
            ctx.static,
        )
        grad_w = None
        if need_w and weights is not None:
            grad_w = launch_backward_weights(
                grad_out,
                prefix,
                suffix,
                p_of_id,
                s_of_id,
                bag_of_id,
                scale.contiguous(),
                weights.dtype,
                ctx.block_elems,
            )
        return grad_p, grad_s, None, None, None, grad_w, None, None, None, None, None


def ttm_bag_triton(
    prefix: torch.Tensor,
    suffix: torch.Tensor,
    prefix_of_id: torch.Tensor,
    suffix_of_id: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    mode: str = "sum",
    embedding_dim: int | None = None,
    *,
    chunk: int = DEFAULT_CHUNK,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    static_shapes: bool = False,
) -> torch.Tensor:
    """Pool bags of TTM rows ``prefix[p(id)] @ suffix[s(id)]`` with the fused kernels.

    Differentiable in ``prefix``, ``suffix`` and ``per_sample_weights``. Runs on CUDA
    tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before the first launch.

    Args:
        prefix: ``(K_p, M_l, r)`` distinct prefixes.
        suffix: ``(K_s, r, M_r)`` distinct suffixes (same dtype and device).
        prefix_of_id: ``(N,)`` prefix index of each id, in ``[0, K_p)``.
        suffix_of_id: ``(N,)`` suffix index of each id, in ``[0, K_s)``.
        offsets: ``(B + 1,)`` bag boundaries (``include_last_offset=True``).
        per_sample_weights: optional ``(N,)``.
        mode: ``"sum"`` or ``"mean"`` (mean divides the weighted sum by the bag length).
        embedding_dim: D, the leading columns kept of each ``M_l * M_r`` row; all when ``None``.
        chunk: most ids of one key summed by one backward program before its atomic add.
        block_elems: bound on a program's tile; tests lower it to exercise the loops.
        static_shapes: cut the backward's work items without host synchronisation
            (:func:`~comera_rec.tensor.kernels.ttm_triton_launch.segments_static`), so that forward and backward can be captured
            in a CUDA graph.

    Returns:
        ``(B, D)`` pooled rows; empty bags give zeros.
    """
    if mode not in POOLING_MODES:
        raise ValueError(f"ttm_bag_triton: mode must be one of {POOLING_MODES}, got {mode!r}")
    if prefix.dim() != 3 or suffix.dim() != 3 or prefix.shape[2] != suffix.shape[1]:
        raise ValueError(
            f"ttm_bag_triton: need prefix (K_p, M_l, r) and suffix (K_s, r, M_r), got "
            f"{tuple(prefix.shape)} and {tuple(suffix.shape)}"
        )
    if prefix.dtype != suffix.dtype or prefix.device != suffix.device:
        raise ValueError("ttm_bag_triton: prefix and suffix need one dtype and device")
    full = prefix.shape[1] * suffix.shape[2]
    dim = full if embedding_dim is None else int(embedding_dim)
    if not 0 <= dim <= full:
        raise ValueError(f"ttm_bag_triton: embedding_dim must be in [0, {full}], got {embedding_dim}")
    if prefix_of_id.shape != suffix_of_id.shape or prefix_of_id.dim() != 1:
        raise ValueError("ttm_bag_triton: prefix_of_id and suffix_of_id must be 1-D of one length")
    if per_sample_weights is not None and per_sample_weights.shape != prefix_of_id.shape:
        raise ValueError("ttm_bag_triton: per_sample_weights must have one weight per id")
    if chunk < 1 or block_elems < 4:
        raise ValueError("ttm_bag_triton: chunk must be >= 1 and block_elems >= 4")
    weights = per_sample_weights.contiguous() if per_sample_weights is not None else None
    return TTMBagFunction.apply(
        prefix.contiguous(),
        suffix.contiguous(),
        prefix_of_id.long().contiguous(),
        suffix_of_id.long().contiguous(),
        offsets.long().contiguous(),
        weights,
        mode == "mean",
        dim,
        int(chunk),
        int(block_elems),
        bool(static_shapes),
    )


def ttm_embedding_bag_triton(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
    *,
    chunk: int = DEFAULT_CHUNK,
    block_elems: int = DEFAULT_BLOCK_ELEMS,
    static_shapes: bool = False,
) -> torch.Tensor:
    """:func:`comera_rec.tensor.contract.ttm_embedding_bag` with the fused kernels.

    The distinct prefixes and suffixes are contracted by the torch code of the halves
    (differentiable in the cores); lookup, contraction and pooling run in one kernel.
    There is no row-level de-duplication: a repeated id costs one more in-register
    contraction of ``D * r`` multiply-adds, not a gathered row.

    Args:
        cores: ``d >= 2`` cores ``(T, r_{k-1}, n_k, m_k, r_k)``, controllers folded in.
        row_shape: ``(n_1..n_d)``.
        embedding_dim: D (<= m_1...m_d).
        ids: ``(N,)`` int64 row ids.
        offsets: ``(B + 1,)`` bag offsets.
        mode: ``"sum"`` or ``"mean"``.
        per_sample_weights: optional ``(N,)``.
        trains: optional ``(N,)`` stacked-table index of each id.
        chunk: see :func:`ttm_bag_triton`.
        block_elems: see :func:`ttm_bag_triton`.
        static_shapes: no ``torch.unique`` and no host synchronisation: both halves are
            contracted whole and each id's own keys index them directly (capturable in
            a CUDA graph; shapes depend on the input shapes only).

    Returns:
        ``(B, D)`` pooled embeddings.
    """
    d = len(cores)
    if d < 2:
        raise ValueError(f"ttm_embedding_bag_triton: need at least 2 cores, got {d}")
    h = split_point(d)
    p_keys, s_keys = half_keys(row_shape, ids, trains)  # (N,) keys into the whole halves
    kept = scoring_halves(cores)
    if static_shapes or kept is not None:
        # whole halves, no host sync: kept while scoring, else made per call (capturable)
        prefix, suffix = kept if kept is not None else whole_halves(cores)
        return ttm_bag_triton(
            prefix,
            suffix,
            p_keys,
            s_keys,
            offsets,
            per_sample_weights,
            mode,
            embedding_dim,
            chunk=chunk,
            block_elems=block_elems,
            static_shapes=True,
        )
    p_distinct, p_of_id = torch.unique(p_keys, return_inverse=True)  # (K_p,), (N,)
    s_distinct, s_of_id = torch.unique(s_keys, return_inverse=True)  # (K_s,), (N,)
    prefix = half(cores[:h], row_shape[:h], p_distinct, left=True)  # (K_p, M_l, r)
    suffix = half(cores[h:], row_shape[h:], s_distinct, left=False)  # (K_s, m_b, r, m_a)
    k_s, m_b, r, m_a = suffix.shape
    suffix = suffix.permute(0, 2, 3, 1).reshape(k_s, r, m_a * m_b)  # (K_s, r, M_r)
    return ttm_bag_triton(
        prefix,
        suffix,
        p_of_id,
        s_of_id,
        offsets,
        per_sample_weights,
        mode,
        embedding_dim,
        chunk=chunk,
        block_elems=block_elems,
    )
