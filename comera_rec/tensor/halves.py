"""The two halves of a stacked TTM train: the pure contractions both lookups share.

A TTM row is ``prefix (M_l, r) x suffix (r, M_r)``: the left half (prefix) is the first
:func:`split_point` cores, the right half (suffix) the rest. This module contracts either
half, for every row index (a table) or for given keys, and computes the keys; the
de-duplicated and static lookups of :mod:`comera_rec.tensor.contract` and the fused Triton
lookup (:mod:`comera_rec.tensor.kernels.ttm_triton`) are built on it. It imports only
torch.

Shapes in comments: ``T`` stacked trains, ``K`` keys, ``N`` row indices of a half,
``M`` its embedding columns, ``r`` the middle rank.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a row-major (C-contiguous) tensor of ``shape``, size-1 dims included.

    Example::

        >>> row_major_strides((1, 4, 3))
        (12, 3, 1)
    """
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` where it is laid out row-major (:func:`row_major_strides`), else a row-major
    copy: unlike ``contiguous``, a dimension of size 1 must have its row-major stride too.

    Example::

        >>> row_major(torch.zeros(1, 4)[:, :2]).stride()
        (2, 1)
    """
    return t if t.stride() == row_major_strides(t.shape) else t.clone(memory_format=torch.contiguous_format)


class _RowMajorGrad(torch.autograd.Function):
    """Identity forward; the gradient handed back in row-major layout."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return row_major(grad)


def row_major_grad(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself in the forward; its gradient comes back row-major.

    The halves reach the cores through permutes and reshapes, and a core's gradient comes
    laid out as the last of them: a parameter would get a gradient with other strides than
    its own, which DDP reports ("Grad strides do not match bucket view strides") and autograd
    copies anyway. :func:`half`, :func:`half_rows` and :func:`whole_halves` take their cores
    through it (parameters are row-major here).

    Example::

        >>> core = torch.ones(1, 2, 3, requires_grad=True)
        >>> row_major_grad(core).permute(2, 1, 0).sum().backward()
        >>> core.grad.stride()
        (6, 3, 1)
    """
    return _RowMajorGrad.apply(x) if x.requires_grad and torch.is_grad_enabled() else x


def split_point(num_cores: int) -> int:
    """How many cores the left half of a ``num_cores``-core train holds: ``ceil(d / 2)``.

    Example::

        >>> [split_point(d) for d in (2, 3, 4, 5)]
        [1, 2, 2, 3]
    """
    return (num_cores + 1) // 2


def left_table(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract the left half (1 or 2 cores) of stacked trains over all its row indices.

    ``cores[k]: (T, r_{k-1}, n_k, m_k, r_k)``, ``r_0 = 1`` ->
    ``(T * N, M, r)`` with N = n_1 n_2 (row-major) and M = m_1 m_2.
    """
    T, _, n1, m1, r1 = cores[0].shape
    if len(cores) == 1:
        return cores[0].reshape(T * n1, m1, r1)
    _, _, n2, m2, r2 = cores[1].shape
    table = torch.bmm(cores[0].reshape(T, n1 * m1, r1), cores[1].reshape(T, r1, n2 * m2 * r2))
    # (T, n1, m1, n2, m2, r2) -> (T, n1, n2, m1, m2, r2): blocks of m2 * r2 stay contiguous
    table = table.reshape(T, n1, m1, n2, m2 * r2).transpose(2, 3)
    return table.reshape(T * n1 * n2, m1 * m2, r2)


def whole_halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both halves of stacked trains over all their row indices, each row's product one
    ``bmm``: ``prefix (T N_l, M_l, r)`` and ``suffix (T N_r, r, m_a m_b)`` (its columns in
    the row's order; differentiable in the cores).

    Example::

        >>> cores = [torch.randn(1, 1, 3, 2, 2), torch.randn(1, 2, 4, 2, 1)]
        >>> prefix, suffix = whole_halves(cores)
        >>> prefix.shape, suffix.shape
        (torch.Size([3, 2, 2]), torch.Size([4, 2, 2]))
    """
    cores = [row_major_grad(c) for c in cores]
    h = split_point(len(cores))
    prefix = left_table(cores[:h])  # (T * N_l, M_l, r)
    suffix = right_table(cores[h:])  # (T * N_r, m_b, r, m_a)
    k_s, m_b, r, m_a = suffix.shape
    return prefix, suffix.permute(0, 2, 3, 1).reshape(k_s, r, m_a * m_b)  # (K_s, r, M_r)


def whole_halves_bytes(cores: Sequence[torch.Tensor], rank_multiple: int = 1) -> int:
    """Bytes of both halves over all their row indices: ``T (N_l M_l + N_r M_r) r`` values,
    the middle rank ``r`` rounded up to a multiple of ``rank_multiple`` (a kernel's padding).

    Example::

        >>> cores = [torch.zeros(1, 1, 10, 2, 4), torch.zeros(1, 4, 20, 8, 1)]
        >>> whole_halves_bytes(cores)  # (10 * 2 + 20 * 8) * 4 float32 values
        2880
    """
    h = split_point(len(cores))
    r = int(cores[h - 1].shape[-1])
    r = -(-r // rank_multiple) * rank_multiple
    left = math.prod(int(c.shape[2]) * int(c.shape[3]) for c in cores[:h])
    right = math.prod(int(c.shape[2]) * int(c.shape[3]) for c in cores[h:])
    return int(cores[0].shape[0]) * (left + right) * r * cores[0].element_size()


def left_rows(cores: Sequence[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
    """Rows ``(K, m_1 m_2, r_2)`` of the whole 2-core left half for ``keys``.

    One GEMM per train gives the half in the layout ``(n_1, m_1, n_2, m_2 r_2)``; each
    key's ``m_1`` blocks of ``m_2 r_2`` contiguous values are gathered from it directly,
    so the half is never transposed (forward or backward).
    """
    T, _, n1, m1, r1 = cores[0].shape
    _, _, n2, m2, r2 = cores[1].shape
    raw = torch.bmm(cores[0].reshape(T, n1 * m1, r1), cores[1].reshape(T, r1, n2 * m2 * r2))
    raw = raw.reshape(T * n1 * m1 * n2, m2 * r2)  # rows (t, i1, a, i2)
    t_i1, i2 = keys // n2, keys % n2  # keys = (t * n1 + i1) * n2 + i2
    a = torch.arange(m1, device=keys.device)
    rows = ((t_i1 * m1).unsqueeze(1) + a) * n2 + i2.unsqueeze(1)  # (K, m1)
    return raw.index_select(0, rows.reshape(-1)).reshape(keys.numel(), m1 * m2, r2)


def right_table(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract the right half (1 or 2 cores) of stacked trains over all its row indices.

    ``cores[k]: (T, r_{k-1}, n_k, m_k, r_k)``, ``r_K = 1`` -> ``(T * N, m_b, r, m_a)``
    with N = n_a n_b (row-major), ``a`` the first and ``b`` the second core (``m_b = 1``
    for one core). Each row's block is written contiguously by the GEMM itself, so no
    permutation of the whole half is ever copied; the caller puts ``m_b`` after ``m_a``
    on the few rows it keeps.
    """
    a = cores[0]
    T, r, na, ma, ra = a.shape
    if len(cores) == 1:
        # (T, r, n, m, 1) -> (T, n, 1, r, m); a copy of one core, not of a table
        return a.reshape(T, r, na, ma).transpose(1, 2).reshape(T * na, 1, r, ma)
    b = cores[1]
    _, _, nb, mb, _ = b.shape
    b_t = b.reshape(T, ra, nb * mb).transpose(1, 2)  # (T, nb*mb, ra), a view
    a_t = a.permute(0, 2, 1, 3, 4).reshape(T, na, r * ma, ra).transpose(2, 3)  # (T, na, ra, r*ma)
    table = torch.matmul(b_t.unsqueeze(1), a_t)  # (T, na, nb*mb, r*ma): (T, na, nb, mb, r, ma)
    return table.reshape(T * na * nb, mb, r, ma)


def right_rows(cores: Sequence[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
    """Rows ``(K, m_b, r, m_a)`` of the whole 2-core right half for ``keys`` (as
    :func:`right_table`), from one GEMM per train.

    The GEMM ``G_b^T (n_b m_b, r_a) @ G_a (r_a, n_a r m_a)`` writes the half as
    ``(n_b, m_b, n_a, r m_a)``; each key's ``m_b`` blocks of ``r m_a`` contiguous values are
    gathered from it directly. Only the first core (small) is permuted, never the half,
    and the backward is two GEMMs, where the batched form (a GEMM per ``(train, i_a)``,
    broadcast over ``i_a``) reduced a half-sized product over ``i_a``.
    """
    a, b = cores
    T, r, na, ma, ra = a.shape
    _, _, nb, mb, _ = b.shape
    a_t = a.permute(0, 4, 2, 1, 3).reshape(T, ra, na * r * ma)  # (T, r_a, n_a r m_a)
    b_t = b.reshape(T, ra, nb * mb).transpose(1, 2)  # (T, n_b m_b, r_a), a view
    raw = torch.bmm(b_t, a_t).reshape(T * nb * mb * na, r * ma)  # rows (t, i_b, b, i_a)
    t_ia, ib = keys // nb, keys % nb  # keys = (t * n_a + i_a) * n_b + i_b
    t, ia = t_ia // na, t_ia % na
    blocks = torch.arange(mb, device=keys.device)
    rows = ((t * nb + ib) * mb).unsqueeze(1) + blocks  # (K, m_b): row (t, i_b, b) ...
    rows = rows * na + ia.unsqueeze(1)  # ... at i_a
    return raw.index_select(0, rows.reshape(-1)).reshape(keys.numel(), mb, r, ma)


def half(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    keys: torch.Tensor,
    left: bool,
    strategy: str = "auto",
) -> torch.Tensor:
    """Per-key matrices of one half: ``(K, M, r)`` (left) or ``(K, m_b, r, m_a)`` (right,
    see :func:`right_table`).

    ``keys`` are ``train * N_half + index``. Either the whole half is contracted for
    every index (one GEMM per core, no gathers) and the keys' rows selected, or only
    the distinct keys are contracted from their gathered core slices; the cheaper
    one, counted in elements touched, is taken (``strategy`` "auto"), or the one named
    ("gather" / "full").
    """
    cores = [row_major_grad(c) for c in cores]
    T = cores[0].shape[0]
    n_half = math.prod(row_shape)
    out_elems = math.prod([c.shape[3] for c in cores]) * (cores[-1].shape[-1] if left else cores[0].shape[1])
    full_cost = T * n_half * out_elems
    # the number of keys bounds the number of distinct keys: no sort needed to decide (lists,
    # not generators, in these sums: a generator argument is a graph break under dynamo)
    gather_cost = keys.numel() * (sum([c[0].numel() // c.shape[2] for c in cores]) + out_elems)
    gather = gather_cost < full_cost if strategy == "auto" else strategy == "gather"
    if len(cores) > 1 and not gather:
        return left_rows(cores, keys) if left else right_rows(cores, keys)
    # Gather the distinct keys' slices of each core, then contract them as one-row trains.
    table_fn = left_table if left else right_table
    distinct, key_of = torch.unique(keys, return_inverse=True)
    train, index = distinct // n_half, distinct % n_half
    slices, stride = [], n_half
    for core, n in zip(cores, row_shape):
        stride //= n
        flat = core.permute(0, 2, 1, 3, 4).reshape(core.shape[0] * n, -1)  # (T*n, r*m*r')
        rows = flat.index_select(0, train * n + (index // stride) % n)
        slices.append(rows.reshape(-1, core.shape[1], 1, core.shape[3], core.shape[4]))
    return table_fn(slices).index_select(0, key_of)  # contracted once per distinct key


def half_keys(
    row_shape: Sequence[int],
    ids: torch.Tensor,
    trains: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix and suffix key of every id: ``train * N_half + index`` into each whole half.

    The left half holds the first :func:`split_point` cores. Shapes follow ``ids``; no
    host synchronisation.

    Args:
        row_shape: ``(n_1..n_d)``.
        ids: ``(N,)`` row ids.
        trains: optional ``(N,)`` stacked-table index of each id.

    Returns:
        ``(prefix_keys (N,), suffix_keys (N,))``, int64.

    Example::

        >>> half_keys((3, 4), torch.tensor([0, 5, 11]), torch.tensor([0, 1, 1]))
        (tensor([0, 4, 5]), tensor([0, 5, 7]))
    """
    h = split_point(len(row_shape))
    n_left, n_right = math.prod(row_shape[:h]), math.prod(row_shape[h:])
    ids = ids.long()
    prefix_keys, suffix_keys = ids // n_right, ids % n_right  # (N,)
    if trains is not None:
        trains = trains.long()
        prefix_keys = trains * n_left + prefix_keys
        suffix_keys = trains * n_right + suffix_keys
    return prefix_keys, suffix_keys


def half_rows(cores: Sequence[torch.Tensor], keys: torch.Tensor, left: bool) -> torch.Tensor:
    """Rows of one whole half for ``keys`` (repeats allowed): ``(K, M, r)`` left,
    ``(K, m_b, r, m_a)`` right. Always the dense contraction of :func:`half`'s "full"
    strategy, also for a one-core half, so no ``torch.unique`` is ever called."""
    cores = [row_major_grad(c) for c in cores]
    if len(cores) > 1:
        return left_rows(cores, keys) if left else right_rows(cores, keys)
    table = left_table(cores) if left else right_table(cores)
    return table.index_select(0, keys)
