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
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Sequence

import torch

from comera_rec.tensor.halves import half, half_keys, left_table, right_table, split_point

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; launching raises
    triton = None
    tl = None

POOLING_MODES = ("sum", "mean")
DEFAULT_CHUNK = 64  # ids per backward work item
DEFAULT_BLOCK_ELEMS = 2048  # bound on a program's 2-D tile (elements)


# ---------------------------------------------------------------------------- kernels
# Plain functions, jitted by _jit() at first launch. Layouts (all contiguous):
#   prefix (K_p, M_L, R), suffix (K_s, R, M_R), out / grad_out (B, D) with D <= M_L * M_R,
#   output column d = a * M_R + b (a < M_L, b < M_R).


def _ttm_bag_fwd_kernel(
    prefix_ptr,
    suffix_ptr,
    p_of_id_ptr,
    s_of_id_ptr,
    weights_ptr,
    offsets_ptr,
    out_ptr,
    D,
    M_L,
    M_R,
    R,
    HAS_WEIGHTS: tl.constexpr,
    MEAN: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,) output columns
    d_mask = d < D
    a = d // M_R  # prefix row of each column
    b = d % M_R  # suffix column of each column
    k = tl.arange(0, BLOCK_R)
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for i in range(start, end):
        p = tl.load(p_of_id_ptr + i)
        s = tl.load(s_of_id_ptr + i)
        row = tl.zeros([BLOCK_D], dtype=ACC)
        for k0 in range(0, R, BLOCK_R):
            kk = k0 + k
            m = d_mask[:, None] & (kk < R)[None, :]  # (BLOCK_D, BLOCK_R)
            pv = tl.load(prefix_ptr + p * (M_L * R) + a[:, None] * R + kk[None, :], mask=m, other=0.0)
            sv = tl.load(suffix_ptr + s * (R * M_R) + kk[None, :] * M_R + b[:, None], mask=m, other=0.0)
            row += tl.sum(pv.to(ACC) * sv.to(ACC), axis=1)
        if HAS_WEIGHTS:
            row = row * tl.load(weights_ptr + i).to(ACC)
        acc += row
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(ACC)
    tl.store(out_ptr + bag * D + d, acc, mask=d_mask)


def _ttm_bag_bwd_prefix_kernel(
    grad_out_ptr,
    suffix_ptr,
    s_of_id_ptr,
    bag_of_id_ptr,
    coef_ptr,
    order_ptr,
    item_key_ptr,
    item_lo_ptr,
    item_hi_ptr,
    grad_prefix_ptr,
    D,
    M_L,
    M_R,
    R,
    ACC: tl.constexpr,
    BLOCK_ML: tl.constexpr,
    BLOCK_MR: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    item = tl.program_id(0)
    kk = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) rank slice
    a = tl.arange(0, BLOCK_ML)
    b = tl.arange(0, BLOCK_MR)
    k_mask = kk < R
    col = a[:, None] * M_R + b[None, :]  # (BLOCK_ML, BLOCK_MR) output column
    g_mask = (a[:, None] < M_L) & (b[None, :] < M_R) & (col < D)
    s_mask = k_mask[:, None] & (b[None, :] < M_R)  # (BLOCK_R, BLOCK_MR)
    key = tl.load(item_key_ptr + item)
    lo = tl.load(item_lo_ptr + item)
    hi = tl.load(item_hi_ptr + item)
    acc = tl.zeros([BLOCK_ML, BLOCK_R], dtype=ACC)
    for j in range(lo, hi):
        i = tl.load(order_ptr + j)
        s = tl.load(s_of_id_ptr + i)
        bag = tl.load(bag_of_id_ptr + i)
        g = tl.load(grad_out_ptr + bag * D + col, mask=g_mask, other=0.0).to(ACC)  # (ML, MR)
        g = g * tl.load(coef_ptr + i).to(ACC)
        sv = tl.load(suffix_ptr + s * (R * M_R) + kk[:, None] * M_R + b[None, :], mask=s_mask, other=0.0)
        acc += tl.sum(g[:, None, :] * sv.to(ACC)[None, :, :], axis=2)  # (ML, R): g @ suffix^T
    # static segments have empty items (lo == hi): no add (broadcast: a scalar mask upsets the interpreter)
    p_mask = (a[:, None] < M_L) & (k_mask & (kk * 0 + hi > lo))[None, :]
    tl.atomic_add(grad_prefix_ptr + key * (M_L * R) + a[:, None] * R + kk[None, :], acc, mask=p_mask)


def _ttm_bag_bwd_suffix_kernel(
    grad_out_ptr,
    prefix_ptr,
    p_of_id_ptr,
    bag_of_id_ptr,
    coef_ptr,
    order_ptr,
    item_key_ptr,
    item_lo_ptr,
    item_hi_ptr,
    grad_suffix_ptr,
    D,
    M_L,
    M_R,
    R,
    ACC: tl.constexpr,
    BLOCK_ML: tl.constexpr,
    BLOCK_MR: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    item = tl.program_id(0)
    kk = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) rank slice
    a = tl.arange(0, BLOCK_ML)
    b = tl.arange(0, BLOCK_MR)
    k_mask = kk < R
    col = a[:, None] * M_R + b[None, :]  # (BLOCK_ML, BLOCK_MR) output column
    g_mask = (a[:, None] < M_L) & (b[None, :] < M_R) & (col < D)
    p_mask = (a[:, None] < M_L) & k_mask[None, :]  # (BLOCK_ML, BLOCK_R)
    key = tl.load(item_key_ptr + item)
    lo = tl.load(item_lo_ptr + item)
    hi = tl.load(item_hi_ptr + item)
    acc = tl.zeros([BLOCK_R, BLOCK_MR], dtype=ACC)
    for j in range(lo, hi):
        i = tl.load(order_ptr + j)
        p = tl.load(p_of_id_ptr + i)
        bag = tl.load(bag_of_id_ptr + i)
        g = tl.load(grad_out_ptr + bag * D + col, mask=g_mask, other=0.0).to(ACC)  # (ML, MR)
        g = g * tl.load(coef_ptr + i).to(ACC)
        pv = tl.load(prefix_ptr + p * (M_L * R) + a[:, None] * R + kk[None, :], mask=p_mask, other=0.0)
        acc += tl.sum(pv.to(ACC)[:, :, None] * g[:, None, :], axis=0)  # (R, MR): prefix^T @ g
    s_mask = (k_mask & (kk * 0 + hi > lo))[:, None] & (b[None, :] < M_R)  # no add for an empty item
    tl.atomic_add(grad_suffix_ptr + key * (R * M_R) + kk[:, None] * M_R + b[None, :], acc, mask=s_mask)


def _ttm_bag_bwd_weights_kernel(
    grad_out_ptr,
    prefix_ptr,
    suffix_ptr,
    p_of_id_ptr,
    s_of_id_ptr,
    bag_of_id_ptr,
    scale_ptr,
    grad_weights_ptr,
    D,
    M_L,
    M_R,
    R,
    ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    p = tl.load(p_of_id_ptr + i)
    s = tl.load(s_of_id_ptr + i)
    bag = tl.load(bag_of_id_ptr + i)
    k = tl.arange(0, BLOCK_R)
    total = tl.zeros([BLOCK_D], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        a = d // M_R
        b = d % M_R
        row = tl.zeros([BLOCK_D], dtype=ACC)
        for k0 in range(0, R, BLOCK_R):
            kk = k0 + k
            m = d_mask[:, None] & (kk < R)[None, :]
            pv = tl.load(prefix_ptr + p * (M_L * R) + a[:, None] * R + kk[None, :], mask=m, other=0.0)
            sv = tl.load(suffix_ptr + s * (R * M_R) + kk[None, :] * M_R + b[:, None], mask=m, other=0.0)
            row += tl.sum(pv.to(ACC) * sv.to(ACC), axis=1)
        g = tl.load(grad_out_ptr + bag * D + d, mask=d_mask, other=0.0).to(ACC)
        total += row * g
    dw = tl.sum(total, axis=0) * tl.load(scale_ptr + i).to(ACC)
    tl.store(grad_weights_ptr + i, dw)


@functools.lru_cache(maxsize=None)
def _jitted(fn: Callable, interpret: bool) -> Callable:
    """``triton.jit(fn)``, made once per kernel and interpreter setting."""
    return triton.jit(fn)


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _jit(fn: Callable) -> Callable:
    if triton is None:
        raise RuntimeError("comera_rec Triton kernels: triton is not installed (pip install 'comera-rec[gpu]')")
    return _jitted(fn, _interpreting())


# ---------------------------------------------------------------------------- launchers


def _pow2(n: int, floor: int = 2) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def _num_warps(tile: int) -> int:
    return 1 if tile <= 256 else 2 if tile <= 1024 else 4


def _acc_dtype(dtype: torch.dtype) -> tuple[object, torch.dtype]:
    """Accumulator: float64 for float64 inputs, float32 otherwise."""
    return (tl.float64, torch.float64) if dtype == torch.float64 else (tl.float32, torch.float32)


def _segments(
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


def _segments_static(
    key_of_id: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_segments` with one (possibly empty) item per id: shapes depend on N only.

    Ids sorted by key; position ``j`` of the sorted order starts an item when it is a
    multiple of ``chunk`` past the first position of its key, the item then covering
    ``order[j : min(j + chunk, end of the key)]``; any other position is an empty item
    (``lo == hi``), which the kernels skip. No ``bincount`` or ``repeat_interleave`` of
    data-dependent length, hence no host synchronisation (capturable in a CUDA graph);
    the price is ``N`` programs instead of about ``K + N / chunk``.

    Returns:
        ``order (N,)`` and per item ``key, lo, hi (N,)``.

    Example::

        >>> order, key, lo, hi = _segments_static(torch.tensor([2, 0, 2, 2]), chunk=2)
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


def _forward(
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
    _jit(_ttm_bag_fwd_kernel)[grid](
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


def _backward_halves(
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
    k_p, m_l, r = prefix.shape
    k_s, _, m_r = suffix.shape
    dim = grad_out.shape[1]
    acc, acc_torch = _acc_dtype(prefix.dtype)
    block_ml, block_mr = _pow2(m_l), _pow2(m_r)
    block_r = min(_pow2(r), max(2, 2 * block_elems // (block_ml * block_mr)))
    warps = _num_warps(block_ml * block_mr * block_r // 2)
    grad_prefix = grad_suffix = None
    if need_prefix:
        buf = torch.zeros(k_p, m_l, r, device=prefix.device, dtype=acc_torch)  # (K_p, M_l, r)
        order, key, lo, hi = _segments_static(p_of_id, chunk) if static else _segments(p_of_id, k_p, chunk)
        if key.numel():
            _jit(_ttm_bag_bwd_prefix_kernel)[(key.numel(), triton.cdiv(r, block_r))](
                grad_out,
                suffix,
                s_of_id,
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
        grad_prefix = buf.to(prefix.dtype)
    if need_suffix:
        buf = torch.zeros(k_s, r, m_r, device=suffix.device, dtype=acc_torch)  # (K_s, r, M_r)
        order, key, lo, hi = _segments_static(s_of_id, chunk) if static else _segments(s_of_id, k_s, chunk)
        if key.numel():
            _jit(_ttm_bag_bwd_suffix_kernel)[(key.numel(), triton.cdiv(r, block_r))](
                grad_out,
                prefix,
                p_of_id,
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
        grad_suffix = buf.to(suffix.dtype)
    return grad_prefix, grad_suffix


def _backward_weights(
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
    n = p_of_id.numel()
    _, m_l, r = prefix.shape
    m_r = suffix.shape[2]
    dim = grad_out.shape[1]
    acc, acc_torch = _acc_dtype(prefix.dtype)
    grad_w = torch.zeros(n, device=prefix.device, dtype=acc_torch)  # (N,)
    if n and dim:
        block_d = min(_pow2(dim), _pow2(block_elems // 2))
        block_r = min(_pow2(r), max(2, block_elems // block_d))
        _jit(_ttm_bag_bwd_weights_kernel)[(n,)](
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


class TTMBagFunction(torch.autograd.Function):
    """Pooled bags of ``prefix[p] @ suffix[s]`` rows, with the fused kernels both ways.

    Saves only the halves and the index tensors; the backward returns gradients for
    ``prefix``, ``suffix`` and the per-sample weights (each only when needed). With
    ``static`` the backward's work items come from :func:`_segments_static`.
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
        return _forward(prefix, suffix, p_of_id, s_of_id, offsets, weights, mean, dim, block_elems)

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
        grad_p, grad_s = _backward_halves(
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
            grad_w = _backward_weights(
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
            (:func:`_segments_static`), so that forward and backward can be captured
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
    if static_shapes:
        prefix = left_table(cores[:h])  # (T * N_l, M_l, r)
        suffix = right_table(cores[h:])  # (T * N_r, m_b, r, m_a)
        k_s, m_b, r, m_a = suffix.shape
        suffix = suffix.permute(0, 2, 3, 1).reshape(k_s, r, m_a * m_b)  # (K_s, r, M_r)
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
