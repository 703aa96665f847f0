"""The sparse arch of a DLRM's inference form (:mod:`comera_rec.dlrm.export`): uncompressed
tables concatenated into one ``embedding_bag``, TTM tables read through their precontracted
halves, one small contraction per distinct ``(table, id)`` key of the batch (or, with
``kernels=True``, the whole lookup one ``torch.ops.comera_rec.ttm_halves_bags`` call: two
halves' rows per TTM id, one row per uncompressed id)."""

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
from comera_rec.dlrm.serving_ops import HALVES_PAD_BYTES
from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.tensor.halves import split_point, whole_halves


class ServingLookup(nn.Module):
    """The sparse arch of a DLRM in inference form: ``(values, lengths (F, B)) -> (B, F, D)``.

    Every feature is read by one table, either uncompressed (one concatenated
    ``embedding_bag``) or a TTM table of a stacked group (de-duplicated lookup over the
    group's precontracted halves). See the module docstring.

    Args:
        feature_names: the sparse features in the arch's (and the inputs') order.
        ebc: a TorchRec ``EmbeddingBagCollection`` or a ``TTMEmbeddingBagCollection``.
        where: the collection's path in the model, for error messages.
        kernels: where TTM tables are read, every bag pooled by
            ``torch.ops.comera_rec.ttm_halves_bags`` (the fused CPU kernel over each
            stack's halves, rank padded to
            :data:`~comera_rec.dlrm.serving_ops.HALVES_PAD_BYTES`, and the uncompressed
            tables' rows; the caller loads the operators) instead of PyTorch operators.

    Raises:
        ExportError: a weighted or sharded collection, an unknown collection type, a
            feature read by several tables or by none, or tables of several dims.
    """

    __module__ = "comera_rec.dlrm.export"  # its public home (re-exported there): exported programs and pickles name it

    def __init__(self, feature_names: list[str], ebc: nn.Module, where: str, kernels: bool = False) -> None:
        super().__init__()
        self.kernels = kernels
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
        self.register_buffer("dense_take", torch.tensor(on, dtype=torch.long))  # 0: another feature's id reads row 0
        self.register_buffer("dense_weight_of", torch.tensor(on, dtype=weight.dtype))

        # ---- TTM groups: halves contracted once over all their row indices; stacks whose
        # halves have one row block shape share one lookup (fewer graph nodes a batch)
        self.groups = nn.ModuleList()
        # kernels: per stack its halves in the kernel's layout and, per feature, the table
        # of the stack it reads (-1: none)
        self.kernel_lefts, self.kernel_rights = nn.ParameterList(), nn.ParameterList()
        self.prefix_rows: list[int] = []
        self.suffix_rows: list[int] = []
        kernel_tables: list[list[int]] = []
        if isinstance(ebc, TTMEmbeddingBagCollection) and kernels:
            for g, stack in enumerate(ebc.groups):
                members = ebc._group_tables[g]
                trains = {i: members.index(table_of[f]) for i, f in enumerate(feature_names) if table_of[f] in members}
                if trains:
                    left, right, n_left, n_right = _kernel_halves(stack)
                    self.kernel_lefts.append(nn.Parameter(left, requires_grad=False))
                    self.kernel_rights.append(nn.Parameter(right, requires_grad=False))
                    self.prefix_rows.append(n_left)
                    self.suffix_rows.append(n_right)
                    kernel_tables.append([trains.get(i, -1) for i in range(num_features)])
        if len(self.kernel_lefts):  # the operator's tables (the plain form keeps none of these)
            self.register_buffer("kernel_tables", torch.tensor(kernel_tables, dtype=torch.long))
            # per feature the first row of its uncompressed table (-1: none) and its rows
            first = [base[i] if on[i] else -1 for i in range(num_features)]
            rows = [dense_weights[table_of[f]].shape[0] if on[i] else 0 for i, f in enumerate(feature_names)]
            self.register_buffer("dense_first", torch.tensor(first, dtype=torch.long))
            self.register_buffer("dense_rows", torch.tensor(rows, dtype=torch.long))
        if isinstance(ebc, TTMEmbeddingBagCollection) and not kernels:
            buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, int, int, dict[int, int]]]] = {}
            for g, stack in enumerate(ebc.groups):
                members = ebc._group_tables[g]
                trains = {i: members.index(table_of[f]) for i, f in enumerate(feature_names) if table_of[f] in members}
                if trains:
                    left, right, n_left, n_right = _stack_halves(stack)
                    key = (tuple(left.shape[1:]), tuple(right.shape[1:]), left.dtype)
                    buckets.setdefault(key, []).append((left, right, n_left, n_right, trains))
            for parts in buckets.values():
                self.groups.append(_ServingTTMHalves(parts, num_features, self.dim))

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``values (N,)`` ids and ``lengths (F, B)`` bag lengths -> ``(B, F, D)`` pooled."""
        num_features, batch = lengths.shape
        # int64 inputs (kjt_inputs) take no conversion: each op is a node of a one-row batch's time
        flat = lengths.reshape(-1)
        flat = flat if flat.dtype == torch.long else flat.long()
        offsets = F.pad(torch.cumsum(flat, 0), (1, 0))  # (F * B + 1,)
        ids = values if values.dtype == torch.long else values.long()
        if len(self.kernel_lefts):
            # (B, F, D), every bag (uncompressed tables' too) pooled by the operator and
            # written sample-major in one pass
            bags = torch.ops.comera_rec.ttm_halves_bags(
                ids,
                offsets,
                self.dense_weight,
                self.dense_first,
                self.dense_rows,
                list(self.kernel_lefts),
                list(self.kernel_rights),
                self.kernel_tables,
                self.prefix_rows,
                self.suffix_rows,
            )
            if self.any_mean:
                divisor = torch.where(self.mean.unsqueeze(1), lengths.clamp_min(1), torch.ones_like(lengths))
                bags = bags / divisor.t().unsqueeze(2)  # (B, F, 1)
            return bags
        bag = torch.repeat_interleave(
            torch.arange(num_features * batch, device=flat.device), flat, output_size=values.shape[0]
        )
        feature = bag // batch  # (N,) the feature of every id
        pooled: Optional[torch.Tensor] = None
        if self.has_dense:
            if self.all_dense:
                pooled = F.embedding_bag(
                    ids + self.dense_base[feature], self.dense_weight, offsets, mode="sum", include_last_offset=True
                )
            else:
                rows = ids * self.dense_take[feature] + self.dense_base[feature]
                pooled = F.embedding_bag(
                    rows,
                    self.dense_weight,
                    offsets,
                    mode="sum",
                    per_sample_weights=self.dense_weight_of[feature],
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


def _stack_halves(stack: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A stack's halves over all their row indices, controllers folded in: ``left (T N_l,
    M_l, r)``, ``right (T N_r, r, m_a m_b)`` (a row's product one bmm, its columns ``(x, a,
    b)``), and ``N_l``, ``N_r``."""
    with torch.no_grad():
        left, right = whole_halves([c.detach() for c in stack.scaled_cores()])
    h = split_point(len(stack.row_shape))
    return left, right, math.prod(stack.row_shape[:h]), math.prod(stack.row_shape[h:])


def _kernel_halves(stack: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A stack's halves as ``torch.ops.comera_rec.ttm_halves_bags`` reads them: ``P (T N_l,
    M_l, rp)`` and ``S (T N_r, M_r, rp)``, the rank zero-padded to a multiple of
    :data:`~comera_rec.dlrm.serving_ops.HALVES_PAD_BYTES`; and ``N_l``, ``N_r``."""
    left, right, n_left, n_right = _stack_halves(stack)  # (T N_l, M_l, r), (T N_r, r, M_r)
    rank = left.shape[-1]
    lanes = max(1, HALVES_PAD_BYTES // left.element_size())
    pad = -rank % lanes
    prefixes = F.pad(left, (0, pad)).contiguous()
    suffixes = F.pad(right.transpose(1, 2), (0, pad)).contiguous()
    return prefixes, suffixes, n_left, n_right


class _ServingTTMHalves(nn.Module):
    """TTM stacks whose halves have one row block shape, their halves concatenated: one
    de-duplicated lookup for all their features.

    Args:
        parts: per stack ``(left, right, N_l, N_r, trains)`` (:func:`_stack_halves`),
            ``trains`` mapping each feature index the stack reads to its table in the stack.
        num_features: features of the input.
        dim: the embedding dim.
    """

    def __init__(
        self, parts: list[tuple[torch.Tensor, torch.Tensor, int, int, dict[int, int]]], num_features: int, dim: int
    ) -> None:
        super().__init__()
        prefix_base, suffix_base = [0] * num_features, [0] * num_features
        n_right, on = [1] * num_features, [False] * num_features
        left_rows = right_rows = 0
        for left, right, n_l, n_r, trains in parts:
            for i, t in trains.items():  # feature i's rows start at its table's in the concatenated halves
                prefix_base[i], suffix_base[i] = left_rows + t * n_l, right_rows + t * n_r
                n_right[i], on[i] = n_r, True
            left_rows += left.shape[0]
            right_rows += right.shape[0]
        # clones: cat of one part would be the part itself, whose storage the program keeps whole
        self.left = nn.Parameter(torch.cat([p[0] for p in parts]).clone(), requires_grad=False)
        self.right = nn.Parameter(torch.cat([p[1] for p in parts]).contiguous().clone(), requires_grad=False)
        self.suffix_rows = right_rows
        self.dim = dim
        self.all_on = all(on)
        self.register_buffer("prefix_base", torch.tensor(prefix_base, dtype=torch.long))
        self.register_buffer("suffix_base", torch.tensor(suffix_base, dtype=torch.long))
        self.register_buffer("n_right", torch.tensor(n_right, dtype=torch.long))
        self.register_buffer("take", torch.tensor(on, dtype=torch.long))
        self.register_buffer("weight_of", torch.tensor(on, dtype=self.left.dtype))

    def forward(self, ids: torch.Tensor, feature: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``(F * B, D)`` bags pooled from these tables (zero for other features)."""
        if not self.all_on:
            ids = ids * self.take[feature]  # other features' ids read a valid row, weighted 0 below
        n_right = self.n_right[feature]
        prefix = self.prefix_base[feature] + ids // n_right
        suffix = self.suffix_base[feature] + ids % n_right
        # each (prefix, suffix) pair, i.e. each (table, id), contracted once
        distinct, key_of = torch.unique(prefix * self.suffix_rows + suffix, return_inverse=True)
        left = self.left.index_select(0, distinct // self.suffix_rows)  # (U, M_l, r)
        right = self.right.index_select(0, distinct % self.suffix_rows)  # (U, r, m_a m_b)
        rows = torch.bmm(left, right)  # (U, M_l, m_a m_b)
        rows = rows.reshape(rows.shape[0], -1)[:, : self.dim]
        weights = None if self.all_on else self.weight_of[feature]
        return F.embedding_bag(key_of, rows, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True)
