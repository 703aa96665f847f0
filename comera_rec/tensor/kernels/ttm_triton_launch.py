"""The launchers of the fused Triton TTM lookup (:mod:`.ttm_triton`): block sizes, grids and
the backward's work items around the kernels of :mod:`.ttm_triton_kernels`.

:func:`launch_forward` pools the bags; :func:`launch_backward_halves` and
:func:`launch_backward_weights` compute the gradients of the halves and of the per-sample
weights; :func:`segments` and :func:`segments_static` cut the ids into the backward's work
items. Each launch takes any tensors the Triton runtime accepts (CUDA, or CPU under the
interpreter).
"""

from __future__ import annotations

import torch

from comera_rec.tensor.kernels.ttm_triton_kernels import (
    jit_kernel,
    ttm_bag_bwd_prefix_kernel,
    ttm_bag_bwd_suffix_kernel,
    ttm_bag_bwd_weights_kernel,
    ttm_bag_fwd_kernel,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; launching raises (jit_kernel)
    triton = None
    tl = None


def _pow2(n: int, floor: int = 2) -> int:
    """The smallest power of two >= ``n``, and at least ``floor``."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def _num_warps(tile: int) -> int:
    """Warps of a program whose tile has ``tile`` elements."""
    return 1 if tile <= 256 else 2 if tile <= 1024 else 4


def _acc_dtype(dtype: torch.dtype) -> tuple[object, torch.dtype]:
    """Accumulator: float64 for float64 inputs, float32 otherwise."""
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def segments(
    key_of_id: torch.Tensor, num_keys: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward work items: ids sorted by key, cut into runs of one key of <= ``chunk`` ids.

    Returns ``order (N,)`` (ids in key order) and per item ``key, lo, hi (I,)``: the item
    covers ``order[lo:hi]``, all of key ``key``.
    """
    order = torch.argsort(key_of_id, stable=True)  # (N,)
    counts = torch.bincount(key_of_id, minlength=num_keys)  # (K,)
    key_start = torch.cumsum(counts, 0) - counts  # (K,) first position of each key in order
    pieces = (counts + chunk - 1) // chunk  # (K,) items per key (0 for absent keys)
    item_key = torch.repeat_interleave(torch.arange(num_keys, device=key_of_id.device), pieces)  # (I,)
    first_item = torch.cumsum(pieces, 0) - pieces  # (K,)
    piece = torch.arange(item_key.numel(), device=key_of_id.device) - first_item[item_key]  # (I,)
    lo = key_start[item_key] + piece * chunk
    hi = torch.minimum(lo + chunk, key_start[item_key] + counts[item_key])
    return order, item_key, lo, hi


def segments_static(
    key_of_id: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`segments` with one (possibly empty) item per id: shapes depend on N only.

    Ids sorted by key; position ``j`` of the sorted order starts an item when it is a
    multiple of ``chunk`` past the first position of its key, the item then covering
    ``order[j : min(j + chunk, end of the key)]``; any other position is an empty item
    (``lo == hi``), which the kernels skip. No ``bincount`` or ``repeat_interleave`` of
    data-dependent length, hence no host synchronisation (capturable in a CUDA graph);
    the price is ``N`` programs instead of about ``K + N / chunk``.

    Returns:
        ``order (N,)`` and per item ``key, lo, hi (N,)``.

    Example::

        >>> order, key, lo, hi = segments_static(torch.tensor([2, 0, 2, 2]), chunk=2)
        >>> key.tolist(), lo.tolist(), hi.tolist()
        ([0, 2, 2, 2], [0, 1, 2, 3], [1, 3, 2, 4])
    """
    n = key_of_id.numel()
    order = torch.argsort(key_of_id, stable=True)  # (N,)
    sorted_keys = key_of_id.index_select(0, order)  # (N,)
    first = torch.searchsorted(sorted_keys, sorted_keys)  # (N,) first position of each key
    end = torch.searchsorted(sorted_keys, sorted_keys, right=True)  # (N,) one past its last
    pos = torch.arange(n, device=key_of_id.device)
    starts = (pos - first) % chunk == 0
    hi = torch.where(starts, torch.minimum(pos + chunk, end), pos)
    return order, sorted_keys, pos, hi


def launch_forward(
    prefix: torch.Tensor,
    suffix: torch.Tensor,
    p_of_id: torch.Tensor,
    s_of_id: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    mean: bool,
    dim: int,
    block_elems: int,
) -> torch.Tensor:
    """Launch the forward kernel: one program per bag and column block.

    Args:
        prefix: ``(K_p, M_l, r)`` distinct prefixes (contiguous).
        suffix: ``(K_s, r, M_r)`` distinct suffixes.
        p_of_id: ``(N,)`` int64 prefix index of each id.
        s_of_id: ``(N,)`` int64 suffix index of each id.
        offsets: ``(B + 1,)`` int64 bag boundaries.
        weights: optional ``(N,)`` per-sample weights.
        mean: divide each bag by its length.
        dim: D, the leading columns kept of each ``M_l * M_r`` row.
        block_elems: bound on a program's tile.

    Returns:
        ``(B, D)`` pooled rows, of ``prefix``'s dtype.
    """
    num_bags = offsets.numel() - 1
    _, m_l, r = prefix.shape
    m_r = suffix.shape[2]
    out = torch.empty(num_bags, dim, device=prefix.device, dtype=prefix.dtype)  # (B, D)
    if num_bags == 0 or dim == 0:
        return out
    acc, _ = _acc_dtype(prefix.dtype)
    block_d = min(_pow2(dim), _pow2(block_elems // 2))
    block_r = min(_pow2(r), max(2, block_elems // block_d))
    grid = (num_bags, triton.cdiv(dim, block_d))
    jit_kernel(ttm_bag_fwd_kernel)[grid](
        prefix,
        suffix,
        p_of_id,
        s_of_id,
        weights if weights is not None else prefix,
        offsets,
        out,
        dim,
        m_l,
        m_r,
        r,
        HAS_WEIGHTS=weights is not None,
        MEAN=mean,
        ACC=acc,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        num_warps=_num_warps(block_d * block_r),
    )
    return out


def launch_backward_halves(
    grad_out: torch.Tensor,
    prefix: torch.Tensor,
    suffix: torch.Tensor,
    p_of_id: torch.Tensor,
    s_of_id: torch.Tensor,
    bag_of_id: torch.Tensor,
    coef: torch.Tensor,
    need_prefix: bool,
    need_suffix: bool,
    chunk: int,
    block_elems: int,
    static: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernels into the halves: one program per work item and rank slice,
    one atomic add per item.

    Args:
        grad_out: ``(B, D)`` contiguous output gradient.
        prefix, suffix, p_of_id, s_of_id: as for :func:`launch_forward`.
        bag_of_id: ``(N,)`` bag of each id.
        coef: ``(N,)`` each id's factor (per-sample weight times the mean's scale).
        need_prefix, need_suffix: which gradients to compute.
        chunk: most ids of one key per work item.
        block_elems: bound on a program's tile.
        static: cut the work items with :func:`segments_static` (no host synchronisation).

    Returns:
        ``(grad_prefix, grad_suffix)``, each ``None`` when not needed.
    """
    k_p, m_l, r = prefix.shape
    k_s, _, m_r = suffix.shape
    dim = grad_out.shape[1]
    acc, acc_torch = _acc_dtype(prefix.dtype)
    block_ml, block_mr = _pow2(m_l), _pow2(m_r)
    block_r = min(_pow2(r), max(2, 2 * block_elems // (block_ml * block_mr)))
    warps = _num_warps(block_ml * block_mr * block_r // 2)

    def slot_gradients(kernel, other: torch.Tensor, other_of_id: torch.Tensor, slot_of_id: torch.Tensor, shape):
        # one half's slot gradients, each slot's ids summed by one program (both halves alike)
        buf = torch.zeros(*shape, device=prefix.device, dtype=acc_torch)
        order, key, lo, hi = segments_static(slot_of_id, chunk) if static else segments(slot_of_id, shape[0], chunk)
        if key.numel():
            jit_kernel(kernel)[(key.numel(), triton.cdiv(r, block_r))](
                grad_out,
                other,
                other_of_id,
                bag_of_id,
                coef,
                order,
                key,
                lo,
                hi,
                buf,
                dim,
                m_l,
                m_r,
                r,
                ACC=acc,
                BLOCK_ML=block_ml,
                BLOCK_MR=block_mr,
                BLOCK_R=block_r,
                num_warps=warps,
            )
        return buf

    grad_prefix = grad_suffix = None
    if need_prefix:  # (K_p, M_l, r)
        grad_prefix = slot_gradients(ttm_bag_bwd_prefix_kernel, suffix, s_of_id, p_of_id, (k_p, m_l, r))
        grad_prefix = grad_prefix.to(prefix.dtype)
    if need_suffix:  # (K_s, r, M_r)
        grad_suffix = slot_gradients(ttm_bag_bwd_suffix_kernel, prefix, p_of_id, s_of_id, (k_s, r, m_r))
        grad_suffix = grad_suffix.to(suffix.dtype)
    return grad_prefix, grad_suffix


def launch_backward_weights(
    grad_out: torch.Tensor,
    prefix: torch.Tensor,
    suffix: torch.Tensor,
    p_of_id: torch.Tensor,
    s_of_id: torch.Tensor,
    bag_of_id: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block_elems: int,
) -> torch.Tensor:
    """Launch the backward kernel into the per-sample weights: one program per id.

    Args:
        grad_out: ``(B, D)`` contiguous output gradient.
        prefix, suffix, p_of_id, s_of_id: as for :func:`launch_forward`.
        bag_of_id: ``(N,)`` bag of each id.
        scale: ``(N,)`` the mean's scale of each id (ones for sums).
        dtype: the weights' dtype.
        block_elems: bound on a program's tile.

    Returns:
        ``(N,)`` gradient of the weights, of ``dtype``.
    """
    n = p_of_id.numel()
    _, m_l, r = prefix.shape
    m_r = suffix.shape[2]
    dim = grad_out.shape[1]
    acc, acc_torch = _acc_dtype(prefix.dtype)
    grad_w = torch.zeros(n, device=prefix.device, dtype=acc_torch)  # (N,)
    if n and dim:
        block_d = min(_pow2(dim), _pow2(block_elems // 2))
        block_r = min(_pow2(r), max(2, block_elems // block_d))
        jit_kernel(ttm_bag_bwd_weights_kernel)[(n,)](
            grad_out,
            prefix,
            suffix,
            p_of_id,
            s_of_id,
            bag_of_id,
            scale,
            grad_w,
            dim,
            m_l,
            m_r,
            r,
            ACC=acc,
            BLOCK_D=block_d,
            BLOCK_R=block_r,
            num_warps=_num_warps(block_d * block_r),
        )
    return grad_w.to(dtype)
