"""Contractions of tensor trains: the TT linear product and the de-duplicated TTM lookup.

Neither ever forms the dense weight or table. Shapes in comments: B batch rows,
N_in / N_out padded feature sizes, r the middle rank, U unique ids, D embedding dim.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from comera_rec.tensor import kernels

# ---------------------------------------------------------------------------- TT linear


def merge_input_chain(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge input-side cores ``(r_{k-1}, n_k, r_k)`` into ``(n_1...n_d, r_d)``.

    Rows are in mixed radix with ``i_1`` most significant. The cost does not depend on
    the batch.
    """
    left = cores[0].reshape(cores[0].shape[1], cores[0].shape[2])  # (n_1, r_1), r_0 = 1
    for core in cores[1:]:
        r_prev, n, r = core.shape
        left = (left @ core.reshape(r_prev, n * r)).reshape(-1, r)  # (N * n_k, r_k)
    return left


def merge_output_chain(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge output-side cores ``(r_{k-1}, n_k, r_k)`` into ``(r_d, n_{d+1}...n_{2d})``."""
    last = cores[-1]
    right = last.reshape(last.shape[0], last.shape[1])  # (r_{2d-1}, n_2d), r_2d = 1
    for core in reversed(cores[:-1]):
        r_prev, n, r = core.shape
        right = (core.reshape(r_prev * n, r) @ right).reshape(r_prev, -1)  # (r_{k-1}, n_k * M)
    return right


class TTLinearFunction(torch.autograd.Function):
    """``y = (x @ left) @ right + bias`` keeping only ``x`` and ``x @ left`` for backward.

    ``left`` (N_in, r) and ``right`` (r, N_out) are the merged chains; their gradients
    ``x^T (dy right^T)`` and ``(x left)^T dy`` are batch-independent in size and flow on
    into the cores through the (small) autograd graph of the merge. The bias is added by
    the second GEMM itself (``addmm``), as ``nn.Linear`` does, not by a pass of its own
    over the ``(B, N_out)`` output.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        t = x @ left  # (B, r)
        ctx.save_for_backward(x, t, left, right)
        return t @ right if bias is None else torch.addmm(bias, t, right)  # (B, N_out)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, t, left, right = ctx.saved_tensors
        grad_x = grad_left = grad_right = grad_bias = None
        grad_t = grad_y @ right.t()  # (B, r)
        if ctx.needs_input_grad[0]:
            grad_x = grad_t @ left.t()  # (B, N_in)
        if ctx.needs_input_grad[1]:
            grad_left = x.t() @ grad_t  # (N_in, r)
        if ctx.needs_input_grad[2]:
            grad_right = t.t() @ grad_y  # (r, N_out)
        if len(ctx.needs_input_grad) > 3 and ctx.needs_input_grad[3]:
            grad_bias = grad_y.sum(0)  # (N_out,)
        grads = (grad_x, grad_left, grad_right, grad_bias)
        return grads[: len(ctx.needs_input_grad)]  # as many as forward was given (bias optional)


def tt_linear(
    x: torch.Tensor,
    input_cores: Sequence[torch.Tensor],
    output_cores: Sequence[torch.Tensor],
    out_features: int,
    bias: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """Apply a TT weight to the last dimension of ``x`` like ``F.linear``.

    On CPU the fused kernel (``kernels/tt_linear_cpu.cpp``) applies it, the bias and the
    ReLU in one pass over the batch; elsewhere two GEMMs (:class:`TTLinearFunction`).

    Args:
        x: ``(..., in_features)``; ``in_features`` may be below the padded N_in.
        input_cores: cores ``(r_{k-1}, n_k, r_k)`` of the input side (controllers folded in).
        output_cores: cores of the output side.
        out_features: the columns kept (<= the padded N_out).
        bias: optional ``(out_features,)``.
        relu: apply the ReLU to the result.

    Returns:
        ``(..., out_features)``.
    """
    in_features = x.shape[-1]
    left = merge_input_chain(input_cores)[:in_features]  # (in_features, r)
    right = merge_output_chain(output_cores)[:, :out_features]  # (r, out_features)
    return linear_from_chains(x, left, right, bias, relu)


def linear_from_chains(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    bias: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """``act(x @ left @ right + bias)`` over the last dimension of ``x``, given a TT
    weight's merged chains: the fused CPU kernel where it applies, else two GEMMs.

    Args:
        x: ``(..., in_features)``.
        left: ``(in_features, r)``.
        right: ``(r, out_features)``.
        bias: optional ``(out_features,)``.
        relu: apply the ReLU to the result.

    Returns:
        ``(..., out_features)``.
    """
    rows = x.reshape(-1, x.shape[-1])
    if kernels.tt_linear_kernel_applies(rows, left, right):
        y = kernels.tt_linear_cpu(rows, left, right, bias, relu)
    else:
        y = TTLinearFunction.apply(rows, left, right, bias)
        if relu:
            y = torch.relu(y)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------- TTM lookup


def _left_table(cores: Sequence[torch.Tensor]) -> torch.Tensor:
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


def _left_rows(cores: Sequence[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
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


def _right_table(cores: Sequence[torch.Tensor]) -> torch.Tensor:
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


def _right_rows(cores: Sequence[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
    """Rows ``(K, m_b, r, m_a)`` of the whole 2-core right half for ``keys`` (as
    :func:`_right_table`), from one GEMM per train.

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


def _half(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    keys: torch.Tensor,
    left: bool,
    strategy: str = "auto",
) -> torch.Tensor:
    """Per-key matrices of one half: ``(K, M, r)`` (left) or ``(K, m_b, r, m_a)`` (right,
    see :func:`_right_table`).

    ``keys`` are ``train * N_half + index``. Either the whole half is contracted for
    every index (one GEMM per core, no gathers) and the keys' rows selected, or only
    the distinct keys are contracted from their gathered core slices; the cheaper
    one, counted in elements touched, is taken (``strategy`` "auto"), or the one named
    ("gather" / "full").
    """
    T = cores[0].shape[0]
    n_half = math.prod(row_shape)
    out_elems = math.prod(c.shape[3] for c in cores) * (cores[-1].shape[-1] if left else cores[0].shape[1])
    full_cost = T * n_half * out_elems
    # the number of keys bounds the number of distinct keys: no sort needed to decide
    gather_cost = keys.numel() * (sum(c[0].numel() // c.shape[2] for c in cores) + out_elems)
    gather = gather_cost < full_cost if strategy == "auto" else strategy == "gather"
    if len(cores) > 1 and not gather:
        return _left_rows(cores, keys) if left else _right_rows(cores, keys)
    # Gather the distinct keys' slices of each core, then contract them as one-row trains.
    table_fn = _left_table if left else _right_table
    distinct, key_of = torch.unique(keys, return_inverse=True)
    train, index = distinct // n_half, distinct % n_half
    slices, stride = [], n_half
    for core, n in zip(cores, row_shape):
        stride //= n
        flat = core.permute(0, 2, 1, 3, 4).reshape(core.shape[0] * n, -1)  # (T*n, r*m*r')
        rows = flat.index_select(0, train * n + (index // stride) % n)
        slices.append(rows.reshape(-1, core.shape[1], 1, core.shape[3], core.shape[4]))
    return table_fn(slices).index_select(0, key_of)  # contracted once per distinct key


def ttm_rows(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    rows: torch.Tensor,
    trains: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of stacked TTM tables, computing each distinct prefix and suffix once.

    The cores are split in a left half (prefix) and a right half (suffix). Each
    distinct prefix ``(train, i_1..i_h)`` among ``rows`` is contracted once, likewise
    each distinct suffix (or, when cheaper, the whole half for every index by dense
    GEMMs); one batched GEMM over the rows then contracts prefix x suffix on the
    middle rank. Pass unique rows (row-level de-duplication is the caller's).

    Args:
        cores: ``d >= 2`` cores of shape ``(T, r_{k-1}, n_k, m_k, r_k)`` (controllers folded in).
        row_shape: ``(n_1, ..., n_d)``.
        rows: ``(U,)`` row indices in ``[0, n_1...n_d)``.
        trains: ``(U,)`` index of the stacked table of each row; ``None`` means table 0.

    Returns:
        ``(U, m_1...m_d)`` rows (the padded embedding dimension).
    """
    d = len(cores)
    if d < 2:
        raise ValueError(f"ttm_rows: need at least 2 cores, got {d}")
    h = (d + 1) // 2
    left_rows, right_rows = math.prod(row_shape[:h]), math.prod(row_shape[h:])
    if trains is None:
        trains = torch.zeros_like(rows)
    prefix = _half(cores[:h], row_shape[:h], trains * left_rows + rows // right_rows, left=True)  # (U, M_l, r)
    suffix = _half(cores[h:], row_shape[h:], trains * right_rows + rows % right_rows, left=False)
    U, m_b, r, m_a = suffix.shape  # (U, m_b, r, m_a)
    # per row: prefix (M_l, r) x suffix (r, m_a, m_b); einsum's own plan was measured ~2x
    # faster here than batched GEMMs of these tiny matrices
    out = torch.einsum("uxr,ubra->uxab", prefix, suffix)  # (U, M_l, m_a, m_b)
    return out.reshape(U, prefix.shape[1] * m_a * m_b)


def pool_bags(
    rows: torch.Tensor,
    row_of_id: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool looked-up rows into bags (``include_last_offset=True`` layout).

    Each id's row is gathered (``index_select``) and added into its bag (``index_add``,
    see :func:`pool_bags_static`): both backward passes are plain scatters / gathers,
    which on CPU made the compressed DLRM step ~4% faster than ``F.embedding_bag``,
    whose backward sorts the ids (docs/performance.md).

    Args:
        rows: ``(U, D)`` distinct rows.
        row_of_id: ``(N,)`` which row each id of the input uses.
        offsets: ``(B + 1,)`` bag boundaries into the N ids (well formed: from 0 to N,
            non-decreasing; the callers build or check them).
        mode: ``"sum"`` or ``"mean"`` (mean divides the weighted sum by the bag length).
        per_sample_weights: optional ``(N,)``.

    Returns:
        ``(B, D)``; empty bags give zeros.

    Example::

        >>> rows = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> pool_bags(rows, torch.tensor([0, 1, 1]), torch.tensor([0, 1, 1, 3]), "sum")
        tensor([[1., 0.],
                [0., 0.],
                [0., 4.]])
    """
    return pool_bags_static(rows.index_select(0, row_of_id), offsets, mode, per_sample_weights)


def ttm_embedding_bag(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
    *,
    static_shapes: bool = False,
    stream_batch: int = 0,
) -> torch.Tensor:
    """De-duplicated TTM embedding-bag lookup.

    Unique ``(train, id)`` pairs are looked up once (row level), their prefixes and
    suffixes once each (tensor-index level, see :func:`ttm_rows`); the bags are then
    pooled. Nothing of the size of the table is formed, forward or backward.

    With ``static_shapes`` nothing is de-duplicated (no ``torch.unique``, no host
    synchronisation, every shape a function of the input shapes, so the lookup can be
    captured in a CUDA graph): both halves are contracted whole and each id takes its
    own prefix and suffix by key (see :func:`ttm_embedding_bag_static`).

    Args:
        cores: ``(T, r_{k-1}, n_k, m_k, r_k)`` stacked cores, controllers folded in.
        row_shape: ``(n_1..n_d)``.
        embedding_dim: D (<= m_1...m_d).
        ids: ``(N,)`` int64 row ids.
        offsets: ``(B + 1,)`` bag offsets.
        mode: ``"sum"`` or ``"mean"``.
        per_sample_weights: optional ``(N,)``.
        trains: optional ``(N,)`` stacked-table index of each id.
        static_shapes: the capturable variant, no de-duplication (see above).
        stream_batch: when > 0, the bags are streams of this many samples (bag
            ``f * stream_batch + b`` is sample ``b`` of stream ``f``) and the result is laid
            out as a KeyedTensor's values: ``(stream_batch, streams * D)``, stream ``f`` in
            columns ``f * D ...``. The fused CPU kernel writes it so directly.

    Returns:
        ``(B, D)`` pooled embeddings, or ``(stream_batch, B / stream_batch * D)``.
    """
    if ids.is_cuda and kernels.triton_enabled():  # fused Triton lookup (docs/gpu.md)
        out = kernels.ttm_embedding_bag_triton(
            cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains,
            static_shapes=static_shapes,
        )
    elif not static_shapes and kernels.cpu_kernel_applies(cores, ids):  # fused C++ lookup (kernels/ttm_cpu.cpp)
        return kernels.ttm_embedding_bag_cpu(
            cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains,
            stream_batch=stream_batch,
        )
    elif static_shapes:
        out = ttm_embedding_bag_static(
            cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains
        )
    else:
        out = _ttm_embedding_bag_dedup(cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains)
    return streams_side_by_side(out, stream_batch) if stream_batch > 0 else out


def streams_side_by_side(out: torch.Tensor, stream_batch: int) -> torch.Tensor:
    """``(F * B, D)`` bags of F streams of B samples -> ``(B, F * D)``, stream ``f`` in columns
    ``f * D ...`` (a copy).

    Example::

        >>> streams_side_by_side(torch.arange(4.0).reshape(4, 1), 2)
        tensor([[0., 2.],
                [1., 3.]])
    """
    bags, dim = out.shape
    if bags % stream_batch:
        raise ValueError(f"streams_side_by_side: {bags} bags are not whole streams of {stream_batch}")
    return out.view(bags // stream_batch, stream_batch, dim).transpose(0, 1).reshape(stream_batch, -1)


def divide_bags(out: torch.Tensor, divisor: torch.Tensor, stream_batch: int = 0) -> torch.Tensor:
    """Divide each bag by its entry of ``divisor`` (``(bags,)``), in either layout of
    :func:`ttm_embedding_bag`: ``(bags, D)``, or with ``stream_batch > 0`` ``(stream_batch,
    streams * D)`` where bag ``f * stream_batch + b`` is row ``b``, columns ``f * D ...``.

    Example::

        >>> divide_bags(torch.ones(2, 4), torch.tensor([1.0, 2.0, 4.0, 8.0]), 2)
        tensor([[1.0000, 1.0000, 0.2500, 0.2500],
                [0.5000, 0.5000, 0.1250, 0.1250]])
    """
    divisor = divisor.to(out.dtype)
    if stream_batch <= 0:
        return out / divisor.unsqueeze(1)
    streams = divisor.numel() // stream_batch
    per_sample = divisor.view(streams, stream_batch).t().unsqueeze(2)  # (stream_batch, streams, 1)
    return (out.view(stream_batch, streams, -1) / per_sample).reshape(stream_batch, -1)


def _ttm_embedding_bag_dedup(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None,
    trains: torch.Tensor | None,
) -> torch.Tensor:
    """The PyTorch path of :func:`ttm_embedding_bag`: ``unique`` rows, then :func:`ttm_rows`."""
    if trains is None:
        unique_ids, row_of_id = torch.unique(ids, return_inverse=True)
        unique_trains = None
    else:
        num_rows = math.prod(row_shape)
        keys, row_of_id = torch.unique(trains * num_rows + ids, return_inverse=True)
        unique_trains, unique_ids = keys // num_rows, keys % num_rows
    rows = ttm_rows(cores, row_shape, unique_ids, unique_trains)[:, :embedding_dim]  # (U, D)
    return pool_bags(rows, row_of_id, offsets, mode, per_sample_weights)


# ---------------------------------------------------------------------------- static shapes


def half_keys(
    row_shape: Sequence[int],
    ids: torch.Tensor,
    trains: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix and suffix key of every id: ``train * N_half + index`` into each whole half.

    The left half holds the first ``h = ceil(d / 2)`` cores. Shapes follow ``ids``; no
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
    h = (len(row_shape) + 1) // 2
    left_rows, right_rows = math.prod(row_shape[:h]), math.prod(row_shape[h:])
    ids = ids.long()
    prefix_keys, suffix_keys = ids // right_rows, ids % right_rows  # (N,)
    if trains is not None:
        trains = trains.long()
        prefix_keys = trains * left_rows + prefix_keys
        suffix_keys = trains * right_rows + suffix_keys
    return prefix_keys, suffix_keys


def _half_rows(cores: Sequence[torch.Tensor], keys: torch.Tensor, left: bool) -> torch.Tensor:
    """Rows of one whole half for ``keys`` (repeats allowed): ``(K, M, r)`` left,
    ``(K, m_b, r, m_a)`` right. Always the dense contraction of :func:`_half`'s "full"
    strategy, also for a one-core half, so no ``torch.unique`` is ever called."""
    if len(cores) > 1:
        return _left_rows(cores, keys) if left else _right_rows(cores, keys)
    table = _left_table(cores) if left else _right_table(cores)
    return table.index_select(0, keys)


def pool_bags_static(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool one row per id into bags by a scatter-add: :func:`pool_bags` with
    ``row_of_id = arange(N)``, without host synchronisation.

    ``offsets`` must be well formed (start at 0, end at N, non-decreasing): nothing is
    checked, as a check would read values on the host.

    Args:
        rows: ``(N, D)``, row ``i`` for id ``i``.
        offsets: ``(B + 1,)`` bag boundaries.
        mode: ``"sum"`` or ``"mean"`` (mean divides the weighted sum by the bag length).
        per_sample_weights: optional ``(N,)``.

    Returns:
        ``(B, D)``; empty bags give zeros.

    Example::

        >>> pool_bags_static(torch.ones(3, 2), torch.tensor([0, 1, 1, 3]), "mean")
        tensor([[1., 1.],
                [0., 0.],
                [1., 1.]])
    """
    n, dim = rows.shape
    lengths = offsets[1:] - offsets[:-1]  # (B,)
    bags = torch.arange(lengths.numel(), device=rows.device)
    # output_size: the length is known from the shape, so no sync to count the ids
    bag_of_id = torch.repeat_interleave(bags, lengths, output_size=n)  # (N,)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.to(rows.dtype).unsqueeze(1)
    out = rows.new_zeros(lengths.numel(), dim).index_add(0, bag_of_id, rows)  # (B, D)
    if mode == "mean":
        out = out / lengths.clamp_min(1).to(out.dtype).unsqueeze(1)
    return out


def ttm_embedding_bag_static(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
) -> torch.Tensor:
    """TTM embedding-bag lookup whose every shape depends on the input shapes only.

    The capturable counterpart of :func:`ttm_embedding_bag` (the PyTorch path; CUDA ids
    with Triton go to the fused kernels instead): no ``torch.unique``, no host
    synchronisation. Each half is contracted for all its indices (one GEMM per train,
    see :func:`_left_rows` / :func:`_right_rows`), every id gathers its own prefix
    ``(M_l, r)`` and suffix by key, one batched contraction gives one row per id, and
    the rows are scatter-added into their bags. It costs a row per id instead of per
    distinct id; the values equal the de-duplicated lookup's up to rounding.

    Args:
        cores: ``d >= 2`` cores ``(T, r_{k-1}, n_k, m_k, r_k)``, controllers folded in.
        row_shape: ``(n_1..n_d)``.
        embedding_dim: D (<= m_1...m_d).
        ids: ``(N,)`` row ids (not range-checked).
        offsets: ``(B + 1,)`` bag offsets.
        mode: ``"sum"`` or ``"mean"``.
        per_sample_weights: optional ``(N,)``.
        trains: optional ``(N,)`` stacked-table index of each id.

    Returns:
        ``(B, D)`` pooled embeddings.

    Example::

        >>> cores = [torch.randn(1, 1, 3, 2, 2), torch.randn(1, 2, 4, 2, 1)]
        >>> ids, offsets = torch.tensor([1, 5, 5]), torch.tensor([0, 2, 3])
        >>> out = ttm_embedding_bag_static(cores, (3, 4), 4, ids, offsets)
        >>> torch.allclose(out, ttm_embedding_bag(cores, (3, 4), 4, ids, offsets), atol=1e-6)
        True
    """
    d = len(cores)
    if d < 2:
        raise ValueError(f"ttm_embedding_bag_static: need at least 2 cores, got {d}")
    h = (d + 1) // 2
    prefix_keys, suffix_keys = half_keys(row_shape, ids, trains)  # (N,), (N,)
    prefix = _half_rows(cores[:h], prefix_keys, left=True)  # (N, M_l, r)
    suffix = _half_rows(cores[h:], suffix_keys, left=False)  # (N, m_b, r, m_a)
    n, m_b, _, m_a = suffix.shape
    rows = torch.einsum("uxr,ubra->uxab", prefix, suffix)  # (N, M_l, m_a, m_b)
    rows = rows.reshape(n, prefix.shape[1] * m_a * m_b)[:, :embedding_dim]  # (N, D)
    return pool_bags_static(rows, offsets, mode, per_sample_weights)


def ttm_dense_table(cores: Sequence[torch.Tensor], train: int = 0) -> torch.Tensor:
    """Reconstruct one whole table ``(n_1...n_d, m_1...m_d)``: for tests and export only."""
    full = cores[0][train]  # (1, n_1, m_1, r_1)
    full = full.reshape(full.shape[1], full.shape[2], full.shape[3])  # (N, M, r)
    for core in cores[1:]:
        c = core[train]  # (r, n, m, r')
        N, M, _ = full.shape
        full = torch.einsum("NMr,rnms->NnMms", full, c).reshape(N * c.shape[1], M * c.shape[2], c.shape[3])
    return full.reshape(full.shape[0], full.shape[1])
