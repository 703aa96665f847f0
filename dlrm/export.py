"""An inference form of a DLRM, dense or compressed, for ``torch.export``.

:func:`serving_model` turns a trained TorchRec ``DLRM`` / ``DLRM_DCN`` (as
:func:`dlrm.model.make_dlrm` builds it, dense or with TTM tables and TT layers) into a
:class:`ServingDLRM`: the same logits from plain PyTorch operators, every shape a function
of the input shapes or of one ``torch.unique`` (no Python branching on data, no C++ kernel
without a fake kernel, no rank controllers). :func:`export_dlrm` exports it with a dynamic
batch and id count; the program is saved with ``torch.export.save`` and runs after
``torch.export.load`` without comera-rec's training code.

What is folded when the serving form is made (values equal up to rounding):

* TTM tables: the controllers go into the cores and each stacked train's two halves (the
  first ``ceil(d / 2)`` cores and the rest) are contracted over all their row indices once;
  a lookup takes the distinct ``(table, id)`` keys of the batch (``torch.unique``), one
  prefix and one suffix per key, one small contraction per key, and pools the bags with
  ``embedding_bag`` over those rows: the de-duplicated TTM lookup.
* TT layers: the controllers go into the cores and each side's chain is merged once into
  ``left (in, r)`` and ``right (r, out)``; the layer is ``x @ left @ right + bias``.
* Uncompressed tables: concatenated into one table read by one ``embedding_bag``
  (the table-batched layout FBGEMM uses); ids of other tables read row 0 with weight 0.
* ``NarrowLinear`` -> linear + ReLU; ``PairwiseDotInteraction`` -> batched GEMM + gather.

Inputs of the program: ``dense_features (B, 13)`` float, and the KeyedJaggedTensor as
``values (N,)`` and ``lengths (F, B)`` (its key-major lengths, one row per feature in
``ServingDLRM.feature_names`` order; :func:`kjt_inputs` makes them). Output: logits ``(B, 1)``.
Ids are not range-checked (an out-of-range id is an indexing error, not a named one).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim, ExportedProgram
from torchrec.distributed.types import ShardedModule
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.dlrm.interaction import PairwiseDotInteraction
from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.tensor.contract import merge_input_chain, merge_output_chain
from comera_rec.tensor.halves import left_table, right_table, split_point
from comera_rec.tensor.linear import NarrowLinear, TTLinear
from comera_rec.tensor.train import TensorTrainModule

PathLike = Union[str, Path]


class ExportError(RuntimeError):
    """A part of the model has no inference form or does not export; the message names it."""


# ------------------------------------------------------------------------------ dense parts


class ServingLinear(nn.Module):
    """``relu?(x @ W^T + b)``: the inference form of ``nn.Linear`` / ``NarrowLinear``.

    Args:
        linear: the layer to copy (weights detached).
        relu: apply a ReLU (a ``NarrowLinear`` with its ReLU fused in).
    """

    def __init__(self, linear: nn.Linear, relu: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False) if linear.bias is not None else None
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return torch.relu(y) if self.relu else y


class ServingTTLinear(nn.Module):
    """A ``TTLinear`` with its chains merged: ``relu?((x @ left) @ right + bias)``.

    Args:
        layer: the TT layer (controllers are folded into its cores first).
    """

    def __init__(self, layer: TTLinear) -> None:
        super().__init__()
        with torch.no_grad():
            inputs, outputs = layer._split()
            left = merge_input_chain(inputs)[: layer.in_features]  # (in, r)
            right = merge_output_chain(outputs)[:, : layer.out_features]  # (r, out)
        # clones: a slice keeps its whole storage, which the saved program would hold too
        self.left = nn.Parameter(left.detach().clone(), requires_grad=False)
        self.right = nn.Parameter(right.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False) if layer.bias is not None else None
        self.relu = layer.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        t = rows @ self.left  # (B, r)
        y = t @ self.right if self.bias is None else torch.addmm(self.bias, t, self.right)
        if self.relu:
            y = torch.relu(y)
        return y.reshape(*x.shape[:-1], y.shape[-1])


class ServingPairwiseDot(nn.Module):
    """``PairwiseDotInteraction`` without its kernel: ``[dense, dots of pairs i < j]``.

    Args:
        num_sparse_features: F.
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("upper", rows * n + cols)  # flat (i, j), i < j, in output order
        self.n = n

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        combined = torch.cat([dense_features.unsqueeze(1), sparse_features], dim=1)  # (B, n, D)
        grid = torch.bmm(combined, combined.transpose(1, 2))  # (B, n, n)
        pairs = grid.reshape(-1, self.n * self.n).index_select(1, self.upper)
        return torch.cat([dense_features, pairs], dim=1)


def _serving_dense_part(module: nn.Module, where: str) -> nn.Module:
    """A copy of ``module`` with every compressed or fused layer in its inference form.

    Raises:
        ExportError: a TT module other than ``TTLinear`` (named by its path) is inside.
    """
    if isinstance(module, TTLinear):
        return ServingTTLinear(module)
    if isinstance(module, NarrowLinear):
        return ServingLinear(module, relu=module.relu)
    if isinstance(module, PairwiseDotInteraction):
        return ServingPairwiseDot(module.num_sparse_features)
    if isinstance(module, TensorTrainModule):
        raise ExportError(f"{where} ({type(module).__name__}): no inference form for this tensor-train module")
    out = copy.copy(module)  # shallow: children are replaced below, parameters shared (not written)
    out._modules = type(module._modules)()
    for name, child in module._modules.items():
        out._modules[name] = None if child is None else _serving_dense_part(child, f"{where}.{name}")
    return out


# ------------------------------------------------------------------------------ lookups


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
        self.left = nn.Parameter(left.clone(), requires_grad=False)
        self.right = nn.Parameter(right.clone(), requires_grad=False)
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
        suffix = self.right.index_select(0, train * self.n_right + row % self.n_right)  # (U, m_b, r, m_a)
        rows = torch.einsum("uxr,ubra->uxab", prefix, suffix)  # (U, M_l, m_a, m_b)
        rows = rows.reshape(rows.shape[0], -1)[:, : self.dim]
        weights = on.to(rows.dtype) if on is not None else None
        return F.embedding_bag(key_of, rows, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True)


# ------------------------------------------------------------------------------ the model


class ServingDLRM(nn.Module):
    """A DLRM in inference form: ``(dense_features, values, lengths) -> logits (B, 1)``.

    Args:
        model: TorchRec ``DLRM`` or ``DLRM_DCN`` (or ``DLRMTrain`` around one),
            unsharded, dense or compressed.

    Raises:
        ExportError: naming the part that has no inference form.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if isinstance(model, DLRMTrain):
            model = model.model
        if not isinstance(model, DLRM):  # DLRM_DCN is a DLRM
            raise ExportError(f"model ({type(model).__name__}): expected TorchRec's DLRM, DLRM_DCN or DLRMTrain")
        sparse = model.sparse_arch
        ebc = getattr(sparse, "embedding_bag_collection", None)
        if ebc is None:
            raise ExportError(f"sparse_arch ({type(sparse).__name__}): has no embedding_bag_collection")
        self.feature_names: list[str] = list(sparse.sparse_feature_names)
        self.dense_in_features = _in_features(model.dense_arch)
        self.dense_arch = _serving_dense_part(model.dense_arch, "dense_arch")
        self.sparse_arch = ServingLookup(self.feature_names, ebc, "sparse_arch.embedding_bag_collection")
        self.inter_arch = _serving_dense_part(model.inter_arch, "inter_arch")
        self.over_arch = _serving_dense_part(model.over_arch, "over_arch")

    def forward(self, dense_features: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, 1)`` of ``dense_features (B, in)``, ids ``values (N,)`` and ``lengths (F, B)``."""
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(values, lengths)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))

    def example_inputs(self, batch_size: int = 4, ids_per_bag: int = 1) -> tuple[torch.Tensor, ...]:
        """Inputs of the right kinds for tracing: id 0 in every bag.

        Args:
            batch_size: B (at least 2: export specialises sizes 0 and 1).
            ids_per_bag: ids in every bag.
        """
        lengths = torch.full((len(self.feature_names), batch_size), ids_per_bag, dtype=torch.long)
        values = torch.zeros(int(lengths.sum()), dtype=torch.long)
        return torch.randn(batch_size, self.dense_in_features), values, lengths


def _in_features(dense_arch: nn.Module) -> int:
    """The dense input width: the first linear layer's ``in_features``."""
    for module in dense_arch.modules():
        if isinstance(module, nn.Linear):
            return module.in_features
        if isinstance(module, TTLinear):
            return module.in_features
    raise ExportError(f"dense_arch ({type(dense_arch).__name__}): no linear layer to take the dense features")


def serving_model(model: nn.Module) -> ServingDLRM:
    """The inference form of a trained DLRM (see the module docstring), in eval mode.

    Args:
        model: TorchRec ``DLRM`` / ``DLRM_DCN`` (or ``DLRMTrain``), dense or compressed.

    Raises:
        ExportError: naming the part that has no inference form.

    Example::

        >>> from comera_rec.dlrm.config import DLRMConfig
        >>> from comera_rec.dlrm.model import build_dlrm
        >>> cfg = DLRMConfig(table_sizes=[20_000, 50], embedding_dim=8, bottom_mlp=[16, 8],
        ...                  top_mlp=[16, 1], rank=4, min_params_to_compress=0)
        >>> serving = serving_model(build_dlrm(cfg))
        >>> serving(*serving.example_inputs(3)).shape
        torch.Size([3, 1])
    """
    return ServingDLRM(model).eval()


def kjt_inputs(features: KeyedJaggedTensor, feature_names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (N,), lengths (F, B))``, int64, of a KeyedJaggedTensor, keys in ``feature_names`` order.

    Args:
        features: one bag per sample and feature (stride B), unweighted.
        feature_names: the model's features (``ServingDLRM.feature_names``).

    Raises:
        ValueError: a feature is missing, or the KJT has variable strides per key.
    """
    if features.variable_stride_per_key():
        raise ValueError("kjt_inputs: variable batch sizes per feature do not export")
    keys = features.keys()
    missing = [f for f in feature_names if f not in keys]
    if missing:
        raise ValueError(f"kjt_inputs: the KeyedJaggedTensor lacks feature(s) {missing}; its keys are {keys}")
    if keys != feature_names:
        features = features.permute([keys.index(f) for f in feature_names])
    # int64: the exported program checks its inputs' dtypes, and traces with int64 ids
    return features.values().long(), features.lengths().long().view(len(feature_names), -1)


def dynamic_shapes() -> tuple[dict[int, Dim], dict[int, Dim], dict[int, Dim]]:
    """The dynamic dims of ``(dense_features, values, lengths)``: batch B and id count N."""
    batch, nnz = Dim("batch", min=1), Dim("nnz", min=0)
    return {0: batch}, {0: nnz}, {1: batch}


def export_dlrm(model: nn.Module, example: Optional[tuple[torch.Tensor, ...]] = None) -> ExportedProgram:
    """``torch.export`` of a DLRM's inference form, batch and id count dynamic.

    Args:
        model: a ``ServingDLRM``, or a DLRM to make one of (:func:`serving_model`).
        example: example ``(dense_features, values, lengths (F, B))``; made when ``None``.

    Returns:
        The exported program: ``ep.module()(dense, values, lengths) -> (B, 1)`` logits.

    Raises:
        ExportError: naming the part that has no inference form or fails to export.

    Example::

        >>> ep = export_dlrm(build_dlrm(cfg))  # doctest: +SKIP
        >>> torch.export.save(ep, "model.pt2")  # doctest: +SKIP
    """
    serving = model if isinstance(model, ServingDLRM) else serving_model(model)
    serving.eval()
    args = example if example is not None else serving.example_inputs()
    with torch.no_grad():
        try:
            return torch.export.export(serving, args, dynamic_shapes=dynamic_shapes(), strict=False)
        except Exception as error:  # find which part fails, for a message that names it
            raise _failing_part(serving, args, error) from error


def _failing_part(serving: ServingDLRM, args: tuple[torch.Tensor, ...], error: Exception) -> ExportError:
    """An ``ExportError`` naming the first part of ``serving`` that does not export alone."""
    dense, values, lengths = args
    embedded_dense = serving.dense_arch(dense)
    embedded_sparse = serving.sparse_arch(values, lengths)
    inter = serving.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
    parts = [
        ("dense_arch", serving.dense_arch, (dense,), {}),
        ("sparse_arch", serving.sparse_arch, (values, lengths), {}),
        ("inter_arch", serving.inter_arch, (), {"dense_features": embedded_dense, "sparse_features": embedded_sparse}),
        ("over_arch", serving.over_arch, (inter,), {}),
    ]
    for name, part, part_args, kwargs in parts:
        try:
            torch.export.export(part, part_args, kwargs, strict=False)
        except Exception as part_error:
            return ExportError(f"{name} ({type(part).__name__}) does not export: {part_error}")
    return ExportError(f"the model does not export (each part alone does): {error}")


def save_exported(program: ExportedProgram, path: PathLike) -> Path:
    """``torch.export.save`` to ``path`` (parents made); the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


def load_exported(path: PathLike) -> nn.Module:
    """The runnable module of a program saved by :func:`save_exported` (``torch.export.load``)."""
    return torch.export.load(str(path)).module()
