"""Fused CPU kernel for the de-duplicated TTM embedding bag (Numba, compiled on first use).

The lookup splits each TT matrix in a left half (prefix cores) and a right half (suffix
cores). Contracting a whole half is one large GEMM, which the CPU runs near its peak, so
the halves stay in PyTorch (``_left_half`` / ``_right_half``), built in the layout that
GEMM writes (rank last) so nothing table-sized is transposed, forward or backward. What
remains per distinct row is small: the prefix matrix ``(M_l, r)`` times the suffix
matrix ``(M_r, r)`` transposed, 256 multiply-adds at rank 16. The PyTorch path spends a
dozen operators on it (gathers of both halves per row, a batched einsum, the pooling's
gather and ``index_add``, as many scatters in backward). Here, in two calls:

* forward: per distinct row, ``M_l M_r`` dot products over the rank, read straight from
  the two half tables by index; then the bags pooled from the rows (threads own bags);
* backward: the bags' gradients scattered onto the distinct rows (serially: bags share
  rows), then two passes that add each row's share into the half tables' gradients:
  rows in their sorted order for the prefix half (distinct rows are sorted by key, so
  their prefixes are non-decreasing and each thread owns whole prefixes), and in suffix
  order for the suffix half. No atomics and no per-thread copies, so results do not
  depend on the number of threads.

Shapes in comments: U distinct rows, N ids, B bags, D embedding dim, M_l / M_r the
prefix / suffix parts of the padded dim (``M_l M_r >= D``), r the middle rank.
"""

from __future__ import annotations

import math
from typing import Sequence

import numba
import numpy as np
import torch

_JIT = dict(cache=True, fastmath=True, nogil=True)


@numba.njit(**_JIT)
def _block(keys, blk, blocks):
    """Rows ``[lo, hi)`` of block ``blk`` of ``blocks``, moved so no key spans two blocks
    (``keys`` non-decreasing)."""
    n = keys.shape[0]
    lo, hi = blk * n // blocks, (blk + 1) * n // blocks
    while 0 < lo < n and keys[lo] == keys[lo - 1]:
        lo += 1
    while 0 < hi < n and keys[hi] == keys[hi - 1]:
        hi += 1
    return lo, hi


# The loops live in serial functions over a range of rows; the parallel drivers only
# split the work.
#
# Layouts (as the GEMMs that build the halves write them, rank last, so every prefix and
# suffix is read in a few contiguous runs and nothing table-sized is transposed):
#   left  (A, m_1, n_2, m_2, r): prefix p -> blocks ``left[p // n_2, a_1, p % n_2]`` of (m_2, r)
#   right (K_r, m_b, m_a, r): suffix s -> one contiguous block ``right[s]``
# and row value ``(x, y)``, x = (a_1, a_2), y = (a, b), sits at ``x * M_r + y``.


@numba.njit(inline="always", **_JIT)
def _prefix_at(left_shape, p):
    """Flat offset of prefix p's first ``(m_2, r)`` block and the stride between its blocks."""
    _, m1, n2, m2, rank = left_shape
    return ((p // n2) * m1 * n2 + p % n2) * m2 * rank, n2 * m2 * rank


@numba.njit(inline="always", **_JIT)
def _prefix_row(left_shape, p, x):
    """Flat offset of row x = (a_1, a_2) of prefix p (r contiguous values)."""
    base, stride = _prefix_at(left_shape, p)
    m2, rank = left_shape[3], left_shape[4]
    return base + (x // m2) * stride + (x % m2) * rank


@numba.njit(inline="always", **_JIT)
def _suffix_row(right_shape, s, y):
    """Flat offset of row y = (a, b) of suffix s (r contiguous values)."""
    _, mb, ma, rank = right_shape
    return ((s * mb + y % mb) * ma + y // mb) * rank


@numba.njit(**_JIT)
def _rows(left, left_shape, right, right_shape, prefix, suffix, rows, lo, hi):
    """``rows[u] = (P_u @ S_u^T).flatten()[:D]`` for u in [lo, hi)."""
    D = rows.shape[1]
    rank = left_shape[4]
    m_r = right_shape[1] * right_shape[2]
    zero = np.zeros(1, left.dtype)[0]  # accumulate in the tables' precision
    for u in range(lo, hi):
        for c in range(D):
            i = _prefix_row(left_shape, prefix[u], c // m_r)
            j = _suffix_row(right_shape, suffix[u], c % m_r)
            pv, sv = left[i : i + rank], right[j : j + rank]
            acc = zero
            for k in range(rank):
                acc += pv[k] * sv[k]
            rows[u, c] = acc


@numba.njit(**_JIT)
def _grad_left(grad_left, left_shape, right, right_shape, prefix, suffix, grad_rows, lo, hi):
    """``dP_u += g_u @ S_u`` for rows [lo, hi) (``g_u`` the row's ``(M_l, M_r)`` gradient)."""
    D = grad_rows.shape[1]
    rank = left_shape[4]
    m_r = right_shape[1] * right_shape[2]
    for u in range(lo, hi):
        for c in range(D):
            i = _prefix_row(left_shape, prefix[u], c // m_r)
            j = _suffix_row(right_shape, suffix[u], c % m_r)
            dst, sv = grad_left[i : i + rank], right[j : j + rank]
            g = grad_rows[u, c]
            for k in range(rank):
                dst[k] += g * sv[k]


@numba.njit(**_JIT)
def _grad_right(grad_right, right_shape, left, left_shape, prefix, suffix, order, grad_rows, lo, hi):
    """``dS_u += g_u^T @ P_u`` for rows ``order[lo:hi]``."""
    D = grad_rows.shape[1]
    rank = left_shape[4]
    m_r = right_shape[1] * right_shape[2]
    for v in range(lo, hi):
        u = order[v]
        for c in range(D):
            i = _prefix_row(left_shape, prefix[u], c // m_r)
            j = _suffix_row(right_shape, suffix[u], c % m_r)
            dst, pv = grad_right[j : j + rank], left[i : i + rank]
            g = grad_rows[u, c]
            for k in range(rank):
                dst[k] += g * pv[k]


@numba.njit(**_JIT)
def _pool(rows, row_of_id, offsets, weights, mean, out, lo, hi):
    """Bags ``[lo, hi)`` of ``out`` from ``rows``."""
    D = out.shape[1]
    weighted = weights.shape[0] > 0
    for bag in range(lo, hi):
        start, end = offsets[bag], offsets[bag + 1]
        for c in range(D):
            out[bag, c] = 0.0
        for j in range(start, end):
            w = weights[j] if weighted else 1.0
            u = row_of_id[j]
            for c in range(D):
                out[bag, c] += w * rows[u, c]
        if mean and end > start:
            for c in range(D):
                out[bag, c] /= end - start


@numba.njit(**_JIT)
def _unpool(grad_out, row_of_id, offsets, weights, mean, grad_rows):
    """``grad_rows[u] += `` the gradient of every bag that reads row u (serial: bags share rows)."""
    B, D = grad_out.shape
    weighted = weights.shape[0] > 0
    for bag in range(B):
        start, end = offsets[bag], offsets[bag + 1]
        scale = 1.0 / (end - start) if mean and end > start else 1.0
        for j in range(start, end):
            w = scale * weights[j] if weighted else scale
            u = row_of_id[j]
            for c in range(D):
                grad_rows[u, c] += w * grad_out[bag, c]


@numba.njit(parallel=True, **_JIT)
def pair_bag_forward(left, right, prefix, suffix, row_of_id, offsets, weights, mean, rows, out, blocks):
    """Rows ``(U, D)`` ``= P_u @ S_u^T`` (flattened, first D values) and the bags ``(B, D)``
    pooled from them.

    ``left (A, m_1, n_2, m_2, r)``, ``right (K_r, m_b, m_a, r)`` (see above);
    ``weights`` is ``(N,)`` or empty; ``mean`` divides each bag by its length.
    """
    U, B = rows.shape[0], out.shape[0]
    left_shape, right_shape = left.shape, right.shape
    left, right = left.ravel(), right.ravel()
    for blk in numba.prange(blocks):
        _rows(left, left_shape, right, right_shape, prefix, suffix, rows, blk * U // blocks, (blk + 1) * U // blocks)
    for blk in numba.prange(blocks):
        _pool(rows, row_of_id, offsets, weights, mean, out, blk * B // blocks, (blk + 1) * B // blocks)


@numba.njit(parallel=True, **_JIT)
def pair_bag_backward(left, right, prefix, suffix, by_suffix, row_of_id, offsets, weights, mean,
                      grad_out, grad_rows, grad_left, grad_right, blocks):
    """Add into ``grad_left`` / ``grad_right`` (zero on entry, shaped like the tables).

    ``prefix`` must be non-decreasing; ``by_suffix`` orders the rows by suffix;
    ``grad_rows (U, D)`` is scratch, zero on entry.
    """
    _unpool(grad_out, row_of_id, offsets, weights, mean, grad_rows)
    left_shape, right_shape = left.shape, right.shape
    left, right = left.ravel(), right.ravel()
    grad_left, grad_right = grad_left.ravel(), grad_right.ravel()  # views: the tables are contiguous
    for blk in numba.prange(blocks):  # threads own whole prefixes
        lo, hi = _block(prefix, blk, blocks)
        _grad_left(grad_left, left_shape, right, right_shape, prefix, suffix, grad_rows, lo, hi)
    sorted_suffix = suffix[by_suffix]
    for blk in numba.prange(blocks):  # threads own whole suffixes
        lo, hi = _block(sorted_suffix, blk, blocks)
        _grad_right(grad_right, right_shape, left, left_shape, prefix, suffix, by_suffix, grad_rows, lo, hi)


# ------------------------------------------------------------------------------ torch glue


def _threads() -> int:
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


class PairBagFunction(torch.autograd.Function):
    """Bags pooled from rows ``P_u @ S_u^T``; gradients for the two half tables."""

    @staticmethod
    def forward(ctx, left, right, prefix, suffix, row_of_id, offsets, weights, mean: bool, embedding_dim: int):
        left, right = left.detach().contiguous(), right.detach().contiguous()
        rows = left.new_empty(prefix.numel(), embedding_dim)  # (U, D)
        out = left.new_empty(offsets.numel() - 1, embedding_dim)  # (B, D)
        pair_bag_forward(left.numpy(), right.numpy(), prefix.numpy(), suffix.numpy(), row_of_id.numpy(),
                         offsets.numpy(), weights.numpy(), mean, rows.numpy(), out.numpy(), _threads())
        ctx.save_for_backward(left, right, prefix, suffix, row_of_id, offsets, weights)
        ctx.mean = mean
        return out

    @staticmethod
    def backward(ctx, grad_out):
        left, right, prefix, suffix, row_of_id, offsets, weights = ctx.saved_tensors
        grad_out = grad_out.detach().contiguous().to(left.dtype)
        grad_rows = left.new_zeros(prefix.numel(), grad_out.shape[1])
        grad_left, grad_right = torch.zeros_like(left), torch.zeros_like(right)
        by_suffix = torch.argsort(suffix)
        pair_bag_backward(left.numpy(), right.numpy(), prefix.numpy(), suffix.numpy(), by_suffix.numpy(),
                          row_of_id.numpy(), offsets.numpy(), weights.numpy(), ctx.mean, grad_out.numpy(),
                          grad_rows.numpy(), grad_left.numpy(), grad_right.numpy(), _threads())
        return grad_left, grad_right, None, None, None, None, None, None, None


def pair_embedding_bag(
    left: torch.Tensor,
    right: torch.Tensor,
    prefix: torch.Tensor,
    suffix: torch.Tensor,
    row_of_id: torch.Tensor,
    offsets: torch.Tensor,
    embedding_dim: int,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pooled bags of the rows ``P_u @ S_u^T`` (prefix matrix ``(M_l, r)`` times suffix matrix
    ``(M_r, r)`` transposed, flattened), fused.

    Args:
        left: ``(A, m_1, n_2, m_2, r)`` prefix half (differentiable): prefix p reads
            ``left[p // n_2, :, p % n_2]`` as an ``(M_l, r)`` matrix.
        right: ``(K_r, m_b, m_a, r)`` suffix half (differentiable): suffix s reads ``right[s]``.
        prefix: ``(U,)`` non-decreasing int64 prefix of each distinct row.
        suffix: ``(U,)`` int64 suffix of each row.
        row_of_id: ``(N,)`` the row of each id.
        offsets: ``(B + 1,)`` bag offsets (well formed).
        embedding_dim: D, the first D of the ``M_l M_r`` values of each row.
        mode: ``"sum"`` or ``"mean"``.
        per_sample_weights: optional ``(N,)`` (no gradient).

    Returns:
        ``(B, D)``.
    """
    if left.shape[-1] != right.shape[-1] or embedding_dim > left.shape[1] * left.shape[3] * right.shape[1] * right.shape[2]:
        raise ValueError(f"pair_embedding_bag: tables {tuple(left.shape)} and {tuple(right.shape)} "
                         f"do not give rows of {embedding_dim} values")
    if prefix.numel() > 1 and bool((prefix.diff() < 0).any()):  # threads own whole prefixes in backward
        raise ValueError("pair_embedding_bag: prefix must be non-decreasing (distinct rows sorted by key)")
    dtype = left.dtype
    weights = (per_sample_weights.detach().to(dtype).contiguous() if per_sample_weights is not None
               else torch.empty(0, dtype=dtype))
    return PairBagFunction.apply(
        left, right.to(dtype), prefix.long().contiguous(), suffix.long().contiguous(),
        row_of_id.long().contiguous(), offsets.long().contiguous(), weights, mode == "mean", embedding_dim,
    )


def _left_half(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """The left half (1 or 2 cores ``(T, r_{k-1}, n_k, m_k, r_k)``) for all its indices, as
    one GEMM writes it: ``(T n_1, m_1, n_2, m_2, r)`` (``n_2 = m_2 = 1`` for one core)."""
    T, _, n1, m1, r1 = cores[0].shape
    if len(cores) == 1:
        return cores[0].reshape(T * n1, m1, 1, 1, r1)
    _, _, n2, m2, r2 = cores[1].shape
    table = torch.bmm(cores[0].reshape(T, n1 * m1, r1), cores[1].reshape(T, r1, n2 * m2 * r2))
    return table.view(T * n1, m1, n2, m2, r2)


def _right_half(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """The right half (1 or 2 cores) for all its indices, rank last: ``(T n_a n_b, m_b, m_a, r)``
    (``n_b = m_b = 1`` for one core). One batched GEMM per train; only the first core, not
    the table, is permuted."""
    T, r, na, ma, ra = cores[0].shape
    if len(cores) == 1:
        return cores[0].reshape(T, r, na, ma).permute(0, 2, 3, 1).reshape(T * na, 1, ma, r)
    _, _, nb, mb, _ = cores[1].shape
    first = cores[0].permute(0, 2, 4, 3, 1).reshape(T, na, ra, ma * r)  # (T, n_a, r_a, m_a r)
    second = cores[1].reshape(T, 1, ra, nb * mb).transpose(2, 3)  # (T, 1, n_b m_b, r_a)
    table = torch.matmul(second, first)  # (T, n_a, n_b m_b, m_a r)
    return table.view(T * na * nb, mb, ma, r)


def _half_for_keys(cores: Sequence[torch.Tensor], row_shape: Sequence[int], keys: torch.Tensor,
                   left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, index)`` of one half for ``keys`` (``train * N_half + index``): the whole
    half, or only its distinct keys when that touches fewer elements (``contract._gathers``)."""
    from comera_rec.tensor.contract import _distinct_slices, _gathers  # contract imports this package

    build = _left_half if left else _right_half
    if not _gathers(cores, row_shape, keys, left, "auto"):
        return build(cores), keys
    slices, key_of = _distinct_slices(cores, row_shape, keys)
    return build(slices), key_of


def _check_inputs(num_rows: int, num_trains: int, ids: torch.Tensor, offsets: torch.Tensor,
                  trains: torch.Tensor | None) -> None:
    """The kernel indexes without bounds checks: reject what would make it read out of range."""
    if ids.numel():
        lo, hi = torch.aminmax(ids)
        if lo < 0 or hi >= num_rows:
            bad = int(lo) if lo < 0 else int(hi)
            raise IndexError(f"ttm_embedding_bag: id {bad} out of range for a table of {num_rows} rows")
        if trains is not None:
            lo, hi = torch.aminmax(trains)
            if lo < 0 or hi >= num_trains:
                raise IndexError(f"ttm_embedding_bag: table index {int(lo) if lo < 0 else int(hi)} out of "
                                 f"range for {num_trains} stacked tables")
    if offsets.numel() == 0 or offsets[0] != 0 or offsets[-1] != ids.numel() or bool((offsets.diff() < 0).any()):
        raise ValueError(f"ttm_embedding_bag: offsets must rise from 0 to the number of ids ({ids.numel()})")


def ttm_embedding_bag_cpu(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused CPU lookup with the signature of ``contract.ttm_embedding_bag``.

    Distinct ``(train, id)`` rows are found by ``torch.unique``; each half is contracted
    by one GEMM per train (or for its distinct keys only, when cheaper), in the layout
    that GEMM writes; the kernel reads both halves by index, contracts each row and
    pools the bags. ``per_sample_weights`` get no gradient.
    """
    num_rows = math.prod(row_shape)
    d = len(cores)
    if d < 2 or d > 4:
        raise ValueError(f"ttm_embedding_bag_cpu: 2 to 4 cores supported, got {d}")
    h = (d + 1) // 2
    n_left, n_right = math.prod(row_shape[:h]), math.prod(row_shape[h:])
    ids = ids.long()
    _check_inputs(num_rows, cores[0].shape[0], ids, offsets, trains)
    if trains is None:
        distinct, row_of_id = torch.unique(ids, return_inverse=True)
        train_of_row = torch.zeros_like(distinct)
    else:
        keys, row_of_id = torch.unique(trains.long() * num_rows + ids, return_inverse=True)
        train_of_row, distinct = keys // num_rows, keys % num_rows
    left, prefix = _half_for_keys(cores[:h], row_shape[:h], train_of_row * n_left + distinct // n_right, True)
    right, suffix = _half_for_keys(cores[h:], row_shape[h:], train_of_row * n_right + distinct % n_right, False)
    return pair_embedding_bag(left, right, prefix, suffix, row_of_id, offsets, embedding_dim, mode,
                              per_sample_weights)
