"""What the pooled and the unpooled TTM collections share: stacked TTM table groups beside
a TorchRec collection of the small tables left dense.

Both :class:`~comera_rec.integration.collection.TTMEmbeddingBagCollection` and
:class:`~comera_rec.integration.embedding_collection.TTMEmbeddingCollection` hold

- ``groups``: an ``nn.ModuleList`` of ``StackedTTMTables``, ``_group_tables[g]`` the table
  names of group ``g`` in stacking order;
- ``dense``: TorchRec's own collection of the dense tables, or ``None``;
- ``plans``: the compression plan of every table; ``_device``: where they were built.

:class:`TTMTableGroups` is the bookkeeping on top of that: the table lists, the device that
follows DMP's initialisation off ``meta``, and the release of in-backward optimisers from
TT parameters.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType

from comera_rec.integration.in_backward import release_in_backward_optimizers
from comera_rec.integration.policy import CompressionPolicy, TablePlan, plan_tables
from comera_rec.tensor.stacked import StackedTTMTables


def distinct_table_names(owner: str, tables: Sequence[Any]) -> list[str]:
    """The tables' names, in order.

    Args:
        owner: the collection's class name, for the error.
        tables: TorchRec table configs (``EmbeddingBagConfig`` or ``EmbeddingConfig``).

    Raises:
        ValueError: two tables share a name (each one's parameters are found by it).
    """
    names = [t.name for t in tables]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{owner}: duplicate table names {duplicates}")
    return names


class TTMTableGroups:
    """Mixin for an ``nn.Module`` collection of TTM table groups and dense TorchRec tables
    (put it before the TorchRec interface in the bases). The class provides
    :meth:`_table_configs` (the configs as given) and :meth:`_dense_modules` (name -> the
    dense table's module, which has a ``weight``)."""

    groups: nn.ModuleList
    dense: nn.Module | None
    plans: Mapping[str, Any]
    _group_tables: list[list[str]]
    _device: torch.device
    _bounds: dict[str, tuple[int, str]]  # feature -> (id bound, table)
    _allow_extra_keys: bool
    _key_cache: dict[tuple[str, ...], tuple[dict[str, int], list[int]]]

    def _table_configs(self) -> Sequence[Any]:
        raise NotImplementedError

    def _dense_modules(self) -> Mapping[str, nn.Module]:
        raise NotImplementedError

    def _plan_tables(
        self,
        owner: str,
        tables: Sequence[Any],
        policy: CompressionPolicy,
        plans: Mapping[str, TablePlan] | None,
    ) -> None:
        """``plans``: each table's plan, the one given in ``plans`` where there is one, else
        ``policy``'s. A table with no feature names reads the feature of its own name, as in
        TorchRec's collections.

        Raises:
            ValueError: a table to compress is not FP32 (``owner`` names the collection).
        """
        for t in tables:
            if not t.feature_names:
                t.feature_names = [t.name]
        self.plans = {}
        planned = plan_tables([(t.name, t.num_embeddings, t.embedding_dim) for t in tables], policy)
        for t in tables:
            plan = (plans or {}).get(t.name) or planned[t.name]
            if plan.compressed and t.data_type != DataType.FP32:
                raise ValueError(f"{owner}: compressed table {t.name!r} must be FP32, got {t.data_type}")
            self.plans[t.name] = plan

    def _stack_compressed(self, tables: Sequence[Any]) -> list[list[Any]]:
        """``groups`` and ``_group_tables``: the compressed tables (by ``plans``) stacked by TT
        shape, each group's tables in config order, on ``_device``. Returns each group's
        configs."""
        by_shape: OrderedDict[tuple, list[Any]] = OrderedDict()
        for t in tables:
            plan = self.plans[t.name]
            if plan.compressed:
                by_shape.setdefault(plan.group_key(t.embedding_dim), []).append(t)
        self.groups = nn.ModuleList()
        self._group_tables = []
        for members in by_shape.values():
            plan = self.plans[members[0].name]
            assert plan.shape is not None and plan.ranks is not None
            self.groups.append(
                StackedTTMTables(
                    [t.num_embeddings for t in members],
                    members[0].embedding_dim,
                    list(plan.ranks),
                    row_shape=plan.shape[0],
                    col_shape=plan.shape[1],
                    device=self._device,
                )
            )
            self._group_tables.append([t.name for t in members])
        return list(by_shape.values())

    def _init_key_checks(self, tables: Sequence[Any]) -> None:
        """Per feature, the id bound of the smallest table that reads it; an empty cache of
        key layouts (:meth:`_key_layout`)."""
        self._bounds = {}
        for t in tables:
            for f in t.feature_names:
                if f not in self._bounds or t.num_embeddings < self._bounds[f][0]:
                    self._bounds[f] = (t.num_embeddings, t.name)
        self._key_cache = {}

    def _key_layout(self, keys: Sequence[str]) -> tuple[dict[str, int], list[int]]:
        """Per KJT key order (cached): each key's position, and each key's id bound (-1: read
        by no table). A feature some table reads that is missing, or a key no table reads
        (unless ``allow_extra_keys``), raises a ``ValueError`` naming it."""
        cache_key = tuple(keys)
        hit = self._key_cache.get(cache_key)
        if hit is not None:
            return hit
        name = type(self).__name__
        index = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self._bounds if f not in index]
        if missing:
            raise ValueError(
                f"{name}: the input KeyedJaggedTensor lacks feature(s) {missing} read by the tables; "
                f"its keys are {list(keys)}"
            )
        extra = [k for k in keys if k not in self._bounds]
        if extra and not self._allow_extra_keys:
            raise ValueError(
                f"{name}: KeyedJaggedTensor key(s) {extra} are in no table config "
                f"(features known: {list(self._bounds)}); pass allow_extra_keys=True to ignore them"
            )
        bounds = [self._bounds[k][0] if k in self._bounds else -1 for k in keys]
        self._key_cache[cache_key] = (index, bounds)
        return index, bounds

    @property
    def device(self) -> torch.device:
        return self._device

    def compressed_tables(self) -> list[str]:
        """Names of the TTM tables."""
        return [n for members in self._group_tables for n in members]

    def dense_tables(self) -> list[str]:
        """Names of the dense tables."""
        return [t.name for t in self._table_configs() if not self.plans[t.name].compressed]

    def table_weight(self, name: str) -> torch.Tensor:
        """The dense ``(num_embeddings, embedding_dim)`` table ``name`` (reconstructed if TTM).

        Meant for tests and export: a TTM table is formed whole.
        """
        for g, members in enumerate(self._group_tables):
            if name in members:
                return self.groups[g].dense_weight(members.index(name))
        dense = self._dense_modules() if self.dense is not None else {}
        if name in dense:
            return dense[name].weight
        raise KeyError(f"{type(self).__name__}: no table named {name!r}")

    def apply(self, fn: Callable[[nn.Module], None]) -> nn.Module:
        """``nn.Module.apply``; when it takes a collection built on ``meta`` off it (as
        ``DistributedModelParallel``'s parameter initialisation does) :attr:`device`
        follows. The TTM groups initialise themselves then (see
        :class:`~comera_rec.tensor.train.InitOnMaterialize`); ``dense`` is TorchRec's."""
        super().apply(fn)  # type: ignore[misc]
        if self._device.type == "meta":
            devices = {p.device for p in self.parameters()}  # type: ignore[attr-defined]
            if len(devices) == 1 and next(iter(devices)).type != "meta":
                self._device = next(iter(devices))
        return self  # type: ignore[return-value]

    def _release_in_backward(self) -> None:
        # TT parameters are replicated, never fused into backward (integration/in_backward.py);
        # a cheap test per forward: the names are built only when something is marked. A
        # forward without gradients (scoring) runs no backward, so it leaves them for later
        if torch.is_grad_enabled() and any(hasattr(p, "_in_backward_optimizers") for p in self.groups.parameters()):
            release_in_backward_optimizers(self.groups.named_parameters(prefix="groups"), type(self).__name__)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """``nn.Module._apply`` (``.to``, ``.cpu``, ``to_empty``), after taking any
        ``apply_optimizer_in_backward`` optimisers off the TT parameters: DMP moves the model
        with ``.to(device)`` just before wrapping it in DDP, whose in-backward path would
        otherwise run them (:mod:`~comera_rec.integration.in_backward`)."""
        self._release_in_backward()
        return super()._apply(fn, recurse)  # type: ignore[misc]
