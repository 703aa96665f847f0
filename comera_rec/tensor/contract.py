"""Contractions of tensor trains: the TT linear product and the de-duplicated TTM lookup.

Neither ever forms the dense weight or table. Shapes in comments: B batch rows,
N_in / N_out padded feature sizes, r the middle rank, U unique ids, D embedding dim.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from comera_rec.tensor import kernels
from comera_rec.tensor.bags import pool_bags, pool_bags_static, streams_side_by_side
from comera_rec.tensor.halves import half, half_keys, half_rows, split_point

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
    def forward(
        ctx, x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        t = x @ left  # (B, r)
        ctx.save_for_backward(x, t, left, right)
        return t @ right if bias is None else torch.addmm(bias, t, right)  # (B, N_out)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        # under autocast the forward's GEMMs ran in autocast's dtype (the gradient's): so do
        # these, and autograd casts each gradient back to its input's dtype
        x, t, left, right = (a.to(grad_y.dtype) for a in ctx.saved_tensors)
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
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if kernels.tt_linear_kernel_applies(rows, left, right):
        y = kernels.tt_linear_cpu(rows, left, right, bias, relu)
    else:
        y = TTLinearFunction.apply(rows, left, right, bias)
        if relu:
            y = torch.relu(y)
    return y if rows is x else y.reshape(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------- TTM lookup


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
    h = split_point(d)
    left_rows, right_rows = math.prod(row_shape[:h]), math.prod(row_shape[h:])
    if trains is None:
        trains = torch.zeros_like(rows)
    prefix = half(cores[:h], row_shape[:h], trains * left_rows + rows // right_rows, left=True)  # (U, M_l, r)
    suffix = half(cores[h:], row_shape[h:], trains * right_rows + rows % right_rows, left=False)
    U, m_b, r, m_a = suffix.shape  # (U, m_b, r, m_a)
    # per row: prefix (M_l, r) x suffix (r, m_a, m_b); einsum's own plan was measured ~2x
    # faster here than batched GEMMs of these tiny matrices
    out = torch.einsum("uxr,ubra->uxab", prefix, suffix)  # (U, M_l, m_a, m_b)
    return out.reshape(U, prefix.shape[1] * m_a * m_b)


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
    middle: torch.Tensor | None = None,
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
        middle: optional ``(T, r)`` controller of the bond between the two halves (after
            core ``split_point(d) - 1``), left out of ``cores``. The fused CPU kernel scales
            the distinct prefixes by it; the other paths fold it into that core first.

    Returns:
        ``(B, D)`` pooled embeddings, or ``(stream_batch, B / stream_batch * D)``.
    """
    fused_cpu = not static_shapes and kernels.cpu_kernel_applies(cores, ids)  # CPU ids only
    if middle is not None and not fused_cpu:  # only the fused CPU lookup takes it apart
        cores, middle = fold_middle(cores, middle), None
    if ids.is_cuda and kernels.triton_enabled():  # fused Triton lookup (docs/gpu.md)
        out = kernels.ttm_embedding_bag_triton(
            cores,
            row_shape,
            embedding_dim,
            ids,
            offsets,
            mode,
            per_sample_weights,
            trains,
            static_shapes=static_shapes,
        )
    elif fused_cpu:  # fused C++ lookup (kernels/ttm_cpu.cpp)
        return kernels.ttm_embedding_bag_cpu(
            cores,
            row_shape,
            embedding_dim,
            ids,
            offsets,
            mode,
            per_sample_weights,
            trains,
            stream_batch=stream_batch,
            middle=middle,
        )
    elif static_shapes:
        out = ttm_embedding_bag_static(cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains)
    else:
        out = _ttm_embedding_bag_dedup(cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains)
    return streams_side_by_side(out, stream_batch) if stream_batch > 0 else out


def fold_middle(cores: Sequence[torch.Tensor], middle: torch.Tensor) -> list[torch.Tensor]:
    """``cores`` with ``middle`` ``(T, r)`` folded into the last rank of core
    ``split_point(d) - 1``, the left half's last: the bond between the halves.

    Example::

        >>> cores = [torch.ones(2, 1, 3, 2, 4), torch.ones(2, 4, 3, 2, 1)]
        >>> fold_middle(cores, torch.full((2, 4), 0.5))[0].sum().item()
        24.0
    """
    bond = split_point(len(cores)) - 1
    if middle.shape != (cores[bond].shape[0], cores[bond].shape[-1]):
        raise ValueError(
            f"fold_middle: the middle controller must be (T, r) = {(cores[bond].shape[0], cores[bond].shape[-1])}, "
            f"got {tuple(middle.shape)}"
        )
    out = list(cores)
    out[bond] = cores[bond] * middle.reshape(middle.shape[0], 1, 1, 1, middle.shape[1])
    return out


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
    see :func:`.halves.left_rows` / :func:`.halves.right_rows`), every id gathers its own prefix
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
    h = split_point(d)
    prefix_keys, suffix_keys = half_keys(row_shape, ids, trains)  # (N,), (N,)
    prefix = half_rows(cores[:h], prefix_keys, left=True)  # (N, M_l, r)
    suffix = half_rows(cores[h:], suffix_keys, left=False)  # (N, m_b, r, m_a)
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
