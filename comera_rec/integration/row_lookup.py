"""Per-id rows of stacked TTM tables, the lookup of
:class:`~comera_rec.integration.embedding_collection.TTMEmbeddingCollection`.

:func:`ttm_lookup_rows` looks up one unpooled embedding row per id, each distinct
``(table, id)`` once, through the fused lookups where they apply (the C++ kernel on CPU,
Triton for CUDA ids) and the tensor core's ``ttm_rows`` elsewhere.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from comera_rec.tensor import kernels
from comera_rec.tensor.contract import ttm_embedding_bag, ttm_rows


def ttm_lookup_rows(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    trains: torch.Tensor | None = None,
    *,
    static_shapes: bool = False,
) -> torch.Tensor:
    """One embedding row per id of stacked TTM tables (no pooling), differentiable in the cores.

    Each distinct ``(train, id)`` is looked up once (row level), and its prefix and
    suffix half-chains once per distinct key (tensor-index level), by the tensor core's
    lookup; the rows are then gathered per id. Where a fused lookup takes the call (the
    C++ kernel for CPU cores, Triton for CUDA ids) the distinct rows are its bags of one
    id each; elsewhere :func:`~comera_rec.tensor.contract.ttm_rows`. With
    ``static_shapes`` nothing is de-duplicated (no ``torch.unique``, no host
    synchronisation): every id is a bag of its own in the capturable lookup.

    Args:
        cores: ``(T, r_{k-1}, n_k, m_k, r_k)`` stacked cores, controllers folded in.
        row_shape: ``(n_1..n_d)``.
        embedding_dim: D (<= m_1...m_d).
        ids: ``(N,)`` row ids (not range-checked here).
        trains: optional ``(N,)`` stacked-table index of each id (table 0 when ``None``).
        static_shapes: the capturable variant (see above).

    Returns:
        ``(N, D)``: row ``i`` is id ``i``'s embedding.

    Example::

        >>> from comera_rec.tensor.stacked import StackedTTMTables
        >>> tables = StackedTTMTables([100, 90], 8, 4, row_shape=(10, 10), col_shape=(2, 4))
        >>> ids, trains = torch.tensor([3, 99, 3, 5]), torch.tensor([0, 0, 0, 1])
        >>> rows = ttm_lookup_rows(tables.scaled_cores(), tables.row_shape, 8, ids, trains)
        >>> rows.shape, torch.equal(rows[0], rows[2])
        (torch.Size([4, 8]), True)
    """
    ids = ids.long()
    trains = trains.long() if trains is not None else None
    if static_shapes:
        unit = torch.arange(ids.numel() + 1, device=ids.device)
        return ttm_embedding_bag(cores, row_shape, embedding_dim, ids, unit, "sum", None, trains, static_shapes=True)
    if trains is None:
        distinct, row_of_id = torch.unique(ids, return_inverse=True)
        distinct_trains = None
    else:
        num_rows = math.prod(row_shape)
        keys, row_of_id = torch.unique(trains * num_rows + ids, return_inverse=True)
        distinct_trains, distinct = keys // num_rows, keys % num_rows
    fused = (ids.is_cuda and kernels.triton_enabled()) or kernels.cpu_kernel_applies(cores, ids)
    if fused and distinct.numel():
        # bags of one id each: the fused lookup's pooling is then the identity
        unit = torch.arange(distinct.numel() + 1, device=ids.device)
        rows = ttm_embedding_bag(cores, row_shape, embedding_dim, distinct, unit, "sum", None, distinct_trains)
    else:
        rows = ttm_rows(cores, row_shape, distinct, distinct_trains)[:, :embedding_dim]  # (U, D)
    return rows.index_select(0, row_of_id)
