"""A ``FusedEmbeddingBagCollection``'s tables through the fused CPU row-wise Adagrad kernel.

TorchRec's fused collection on CPU keeps its tables in one FBGEMM table-batched
embedding (TBE) whose backward applies exact row-wise Adagrad. When that TBE is a plain
one (host memory, float32, sum pooling, row-wise Adagrad with no weight decay, clipping
or norm limits) the lookup here reads the same weight buffer and its backward updates the
same weight and momentum buffers in place with the same rule
(:mod:`comera_rec.integration.rowwise_bag_kernel`), so checkpoints, the fused optimizer's
state and sharding plans are those of the TBE. Anything else goes through FBGEMM.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

from comera_rec.integration.rowwise_bag_kernel import (
    RowwiseTables,
    rowwise_adagrad_bag,
    rowwise_bag_kernel_applies,
    rowwise_bag_kernel_enabled,
)
from comera_rec.integration.torchrec_internals import fused_lookup_tables, fused_lookups, lookup_tbe

# The TBE optimizer arguments the kernel implements (FusedEmbeddingBagCollection's
# defaults for row-wise Adagrad); any other value leaves the lookup to FBGEMM.
_PLAIN_OPTIMIZER_ARGS = {
    "gradient_clipping": False,
    "max_norm": 0.0,
    "weight_decay": 0.0,
    "weight_decay_mode": 0,
    "counter_halflife": -1,
    "learning_rate_mode": -1,
    "grad_sum_decay": -1,
    "regularization_mode": 0,
    "weight_norm_coefficient": 0.0,
    "use_rowwise_bias_correction": False,
}
_layouts: "weakref.WeakKeyDictionary[nn.Module, RowwiseTables]" = weakref.WeakKeyDictionary()  # per TBE, made once


def single_lookup(collection: nn.Module, feature_names: Sequence[str]) -> nn.Module | None:
    """The one table-batched lookup of an unsharded ``FusedEmbeddingBagCollection`` whose
    features come in ``feature_names`` order, or ``None`` (sharded, several lookups, other
    order): then its ids can be handed to the lookup as they come, without the per-feature
    split and concatenation of ``FusedEmbeddingBagCollection.forward``."""
    if type(collection) is not FusedEmbeddingBagCollection:
        return None
    lookups = fused_lookups(collection)
    if len(lookups) != 1:
        return None
    tables = fused_lookup_tables(collection)[0]
    if [f for t in tables for f in t.feature_names] != list(feature_names):
        return None
    return lookups[0]


def _plain_tbe(lookup: nn.Module) -> nn.Module | None:
    """The FBGEMM TBE inside a TorchRec fused lookup when the kernel can stand in for it."""
    tbe = lookup_tbe(lookup)
    if tbe is None or not hasattr(tbe, "optimizer_args"):
        return None
    args = tbe.optimizer_args
    if (
        tbe.optimizer != EmbOptimType.EXACT_ROWWISE_ADAGRAD
        or tbe.pooling_mode != PoolingMode.SUM
        or any(getattr(args, k, v) != v for k, v in _PLAIN_OPTIMIZER_ARGS.items())
        or tbe.weights_host.numel() == 0  # tables on a device, in UVM or a cache
        or tbe.weights_dev.numel() + tbe.weights_uvm.numel() > 0
        or tbe.momentum1_host.numel() != tbe.total_hash_size
    ):
        return None
    return tbe


def _tables_of(tbe: nn.Module) -> RowwiseTables:
    return RowwiseTables(
        table_offset=tbe.weights_offsets.long(),
        momentum_offset=tbe.momentum1_offsets.long(),
        dim_offset=tbe.D_offsets.long(),
        rows=tbe.rows_per_table.long(),
        feature_table=torch.tensor(tbe.feature_table_map, dtype=torch.long),
    )


def fused_tables_lookup(
    lookup: nn.Module,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    batch: int,
    out_columns: tuple[int, Sequence[int]] | None = None,
) -> torch.Tensor:
    """Pooled ``(batch, total_dim)`` values of a fused collection's single lookup
    (:func:`single_lookup`), through the fused CPU kernel when it applies, else FBGEMM.

    Args:
        lookup: the collection's one lookup (:func:`single_lookup`).
        ids: ids of all features, feature after feature in the lookup's order.
        lengths: ``(F * batch,)`` bag lengths.
        weights: per-id weights or ``None``.
        batch: samples per feature.
        out_columns: ``(width, cols)``: the bags in a ``(batch, width)`` output instead,
            feature ``f`` (of one dim ``D``) at columns ``cols[f] ...``; the other columns
            are the caller's to write in place (the fused kernel leaves them unwritten,
            FBGEMM's path zeros).
    """
    tbe = _plain_tbe(lookup) if rowwise_bag_kernel_enabled() else None
    if tbe is not None and rowwise_bag_kernel_applies(tbe.weights_host, tbe.momentum1_host, ids):
        tables = _layouts.get(tbe)
        if tables is None:
            tables = _layouts[tbe] = _tables_of(tbe)
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.long())
        out = rowwise_adagrad_bag(
            tbe.weights_host,
            tbe.momentum1_host,
            tables,
            ids,
            offsets,
            weights,
            batch,
            tbe.learning_rate_tensor,
            tbe.optimizer_args.eps,
            out_columns=out_columns,
        )
        _count_step(tbe)
        return out
    # as FusedEmbeddingBagCollection.forward hands them on: int32 ids and offsets
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    out = lookup(ids.int(), offsets.int(), weights)
    if out_columns is None:
        return out
    width, cols = out_columns
    dim = out.shape[1] // len(cols)
    index = torch.cat([torch.arange(c, c + dim) for c in cols]).to(out.device)
    return out.new_zeros(batch, width).index_copy(1, index, out)


def _count_step(tbe: nn.Module) -> None:
    """Advance the TBE's step counters as its own forward does (they are checkpointed)."""
    tbe.step += 1
    iter_cpu = getattr(tbe, "iter_cpu", None)
    if iter_cpu is not None:
        if iter_cpu.item() == 0:
            iter_cpu.fill_(tbe.iter.cpu().item())
        iter_cpu.add_(1)
    tbe.iter.add_(1)
