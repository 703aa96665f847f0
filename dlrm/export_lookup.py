"""The sparse arch of a DLRM's inference form (:mod:`comera_rec.dlrm.export`): uncompressed
tables concatenated into one ``embedding_bag``, TTM tables read through their precontracted
halves, one small contraction per distinct ``(table, id)`` key of the batch."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from comera_rec.dlrm.export_layers import ExportError
from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.tensor.halves import left_table, right_table, split_point


class ServingLookup(nn.Module):
    """The sparse arch of a DLRM in inference form: ``(values, lengths (F, B)) -> (B, F, D)``.

    Every feature is read by one table, either uncompressed (one concatenated
    ``embedding_bag``) or a TTM table of a stacked group (de-duplicated lookup over the
    group's precontracted halves). See the module docstring.

    Args:
        feature_names: the sparse features in the arch's (and the inputs') order.
        ebc: a TorchRec ``EmbeddingBagCollection`` or a ``TTMEmbeddingBagCollection``.
        where: the collection's path in the model, for error messages.

    Raises:
        ExportError: a weighted or sharded collection, an unknown collection type, a
            feature read by several tables or by none, or tables of several dims.
    """

    __module__ = "comera_rec.dlrm.export"  # its public home (re-exported there): exported programs and pickles name it

    def __init__(self, feature_names: list[str], ebc: nn.Module, where: str) -> None:
        super().__init__()
        kind = type(ebc).__name__
        if not isinstance(ebc, (EmbeddingBagCollection, TTMEmbeddingBagCollection)):
            raise ExportError(f"{where} ({kind}): only EmbeddingBagCollection and TTMEmbeddingBagCollection export")
        if ebc.is_weighted():
            raise ExportError(f"{where} ({kind}): weighted (per-id weights) collections do not export")
        self.feature_names = list(feature_names)
        configs = {t.name: t for t in ebc.embedding_bag_configs()}
        table_of: dict[str, str] = {}
        for t in configs.values():
            for f in t.feature_names:
                if f in table_of:
                    raise ExportError(
                        f"{where} ({kind}): feature {f!r} is read by tables {table_of[f]!r} and {t.name!r}"
                    )
                table_of[f] = t.name
        missing = [f for f in feature_names if f not in table_of]
        if missing:
            raise ExportError(f"{where} ({kind}): no table reads feature(s) {missing}")
        dims = {configs[table_of[f]].embedding_dim for f in feature_names}
        if len(dims) != 1:
            raise ExportError(f"{where} ({kind}): tables of several embedding dims {sorted(dims)}")
        self.dim = dims.pop()
        num_features = len(feature_names)
        self.register_buffer(
            "mean", torch.tensor([configs[table_of[f]].pooling == PoolingType.MEAN for f in feature_names])
        )
        self.any_mean = bool(self.mean.any())

        # ---- uncompressed tables: one concatenated table
        dense_weights: dict[str, torch.Tensor] = {}
        if isinstance(ebc, EmbeddingBagCollection):
            state = ebc.state_dict()
            dense_weights = {name: state[f"embedding_bags.{name}.weight"] for name in configs}
        else:
            if isinstance(ebc.dense, ShardedModule):
                raise ExportError(f"{where}.dense ({type(ebc.dense).__name__}): sharded tables do not export")
            if ebc.dense is not None:
                state = ebc.dense.state_dict()
                dense_weights = {name: state[f"embedding_bags.{name}.weight"] for name in ebc.dense_tables()}
        base, on, parts, row = [0] * num_features, [False] * num_features, [], 0
        starts: dict[str, int] = {}
        for name, weight in dense_weights.items():
            starts[name] = row
            parts.append(weight.detach())
            row += weight.shape[0]
        for i, f in enumerate(feature_names):
            if table_of[f] in starts:
                base[i], on[i] = starts[table_of[f]], True
        self.has_dense = any(on)
        self.all_dense = all(on)
        # one copy of the uncompressed tables, as FBGEMM's table-batched layout holds them
        weight = torch.cat(parts) if self.has_dense else torch.zeros(1, self.dim)
        self.dense_weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("dense_base", torch.tensor(base, dtype=torch.long))
        self.register_buffer("dense_on", torch.tensor(on))

        # ---- TTM groups: halves contracted once over all their row indices
        self.groups = nn.ModuleList()
        if isinstance(ebc, TTMEmbeddingBagCollection):
            for g, stack in enumerate(ebc.groups):
                members = ebc._group_tables[g]
                train, member_on = [0] * num_features, [False] * num_features
                for i, f in enumerate(feature_names):
                    if table_of[f] in members:
                        train[i], member_on[i] = members.index(table_of[f]), True
                if any(member_on):
                    self.groups.append(_ServingTTMGroup(stack, train, member_on))

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``values (N,)`` ids and ``lengths (F, B)`` bag lengths -> ``(B, F, D)`` pooled."""
        num_features, batch = lengths.shape
        flat = lengths.reshape(-1).long()
        offsets = torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)])  # (F * B + 1,)
        bag = torch.repeat_interleave(
            torch.arange(num_features * batch, device=flat.device), flat, output_size=values.shape[0]
        )
        feature = bag // batch  # (N,) the feature of every id
        ids = values.long()
        pooled: Optional[torch.Tensor] = None
        if self.has_dense:
            if self.all_dense:
                pooled = F.embedding_bag(
                    ids + self.dense_base[feature], self.dense_weight, offsets, mode="sum", include_last_offset=True
                )
            else:
                on = self.dense_on[feature]
                rows = torch.where(on, ids + self.dense_base[feature], torch.zeros_like(ids))
                pooled = F.embedding_bag(
                    rows,
                    self.dense_weight,
                    offsets,
                    mode="sum",
                    per_sample_weights=on.to(self.dense_weight.dtype),
                    include_last_offset=True,
                )
        for group in self.groups:
            part = group(ids, feature, offsets)
            pooled = part if pooled is None else pooled + part
        assert pooled is not None
        if self.any_mean:
            is_mean = self.mean.unsqueeze(1).expand(num_features, batch).reshape(-1)
            pooled = pooled / torch.where(is_mean, flat.clamp_min(1), torch.ones_like(flat)).unsqueeze(1)
        return pooled.view(num_features, batch, self.dim).transpose(0, 1)


class _ServingTTMGroup(nn.Module):
    """One stack of TTM tables: precontracted halves and which features read which train."""

    def __init__(self, stack: nn.Module, train: list[int], on: list[bool]) -> None:
        super().__init__()
        with torch.no_grad():
            cores = [c.detach() for c in stack.scaled_cores()]  # controllers folded in
            h = split_point(len(cores))
            left = left_table(cores[:h])  # (T * N_l, M_l, r)
            right = right_table(cores[h:])  # (T * N_r, m_b, r, m_a)
            # (T * N_r, r, m_a m_b): a row's product is then one bmm, its columns (x, a, b)
            right = right.permute(0, 2, 3, 1).reshape(right.shape[0], right.shape[2], -1)
        self.left = nn.Parameter(left.clone(), requires_grad=False)
        self.right = nn.Parameter(right.contiguous(), requires_grad=False)
        self.num_rows = math.prod(stack.row_shape)
        self.n_left, self.n_right = math.prod(stack.row_shape[:h]), math.prod(stack.row_shape[h:])
        self.dim = stack.embedding_dim
        self.all_on = all(on)
        self.register_buffer("train_of", torch.tensor(train, dtype=torch.long))
        self.register_buffer("on_of", torch.tensor(on))

    def forward(self, ids: torch.Tensor, feature: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``(F * B, D)`` bags pooled from this group's tables (zero for other features)."""
        keys = self.train_of[feature] * self.num_rows + ids
        on = None
        if not self.all_on:
            on = self.on_of[feature]
            keys = torch.where(on, keys, torch.zeros_like(keys))  # any valid key; weight 0 below
        distinct, key_of = torch.unique(keys, return_inverse=True)  # each (table, id) once
        train, row = distinct // self.num_rows, distinct % self.num_rows
        prefix = self.left.index_select(0, train * self.n_left + row // self.n_right)  # (U, M_l, r)
        suffix = self.right.index_select(0, train * self.n_right + row % self.n_right)  # (U, r, m_a m_b)
        rows = torch.bmm(prefix, suffix)  # (U, M_l, m_a m_b)
        rows = rows.reshape(rows.shape[0], -1)[:, : self.dim]
        weights = on.to(rows.dtype) if on is not None else None
        return F.embedding_bag(key_of, rows, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True)
