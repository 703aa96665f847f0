"""TTMEmbeddingBagCollection: a drop-in TorchRec EmbeddingBagCollection with TTM tables.

Large tables are tensor-train matrices (TTM); tables of one TT shape are stacked and
looked up in one call. Small tables stay dense in a TorchRec ``EmbeddingBagCollection``
submodule (``dense``), so TorchRec's sharders and planner treat them exactly as in any
other model: under ``DistributedModelParallel`` they become FBGEMM table-batched
kernels with a fused optimizer, sharded across ranks. The collection's output layout and
the checks of its input are in :mod:`~comera_rec.integration.collection_layout`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from comera_rec.integration.collection_layout import (
    COLLECTION_NAME,
    BagOutputLayout,
    check_input_kind,
    check_jagged_batch,
    one_batch_size,
)
from comera_rec.integration.fused_tables import fused_tables_lookup, single_lookup
from comera_rec.integration.in_backward import carry_in_backward_optimizers
from comera_rec.integration.policy import CompressionPolicy, TablePlan
from comera_rec.integration.table_groups import TTMTableGroups, distinct_table_names
from comera_rec.tensor import kernels
from comera_rec.tensor.bags import divide_bags
from comera_rec.tensor.derived import cache_applies, derived_cache, scoring_cache_on
from comera_rec.tensor.stacked import StackedTTMTables

_POOLINGS = (PoolingType.SUM, PoolingType.MEAN)


def fx_opaque(module: nn.Module, method: str, *args: object) -> object:
    """``getattr(module, method)(*args)``; FX symbolic tracing records it as one call.

    TorchRec's train pipelines (``TrainPipelineSparseDist`` and its kin) FX-trace the
    model to find each sharded module and where its input comes from in the batch. The
    tracer enters every module that holds a sharded one (a collection with a ``dense``
    child under DMP) and, in a model with no sharded module at all, every module. Wrapped
    with ``torch.fx.wrap``, the collection's checks and lookups are one node of that graph,
    their Python control flow never sees a proxy; outside tracing (and when a traced graph
    is run) it is a plain call.
    """
    return getattr(module, method)(*args)


torch.fx.wrap("fx_opaque")


# The most bytes of dense tables the scoring path stacks into one (a copy kept while
# scoring): small tables, where one lookup call instead of one per table pays; larger ones
# keep their calls and are not copied.
STACKED_DENSE_MAX_BYTES = 64 << 20


class TTMEmbeddingBagCollection(TTMTableGroups, EmbeddingBagCollectionInterface):
    """An ``EmbeddingBagCollection`` whose large tables are TTM tensor trains.

    Output keys, their order and ``length_per_key`` are those of TorchRec's
    ``EmbeddingBagCollection`` for the same configs (a feature read by several tables
    is named ``feature@table``). The ``policy`` decides per table whether it is
    compressed, at which rank and shape; the others stay dense in the ``dense``
    submodule. Compressed tables with equal (row factors, column factors, ranks,
    embedding_dim) form one :class:`~comera_rec.tensor.stacked.StackedTTMTables` in
    ``groups`` and are looked up together.

    Args:
        tables: the table configs (SUM or MEAN pooling; compressed tables must be FP32).
        policy: what to compress; ``CompressionPolicy()`` when ``None``.
        is_weighted: whether input KJTs carry per-id weights (weighted pooling).
        device: where to allocate (``"meta"`` allocates nothing; TorchRec's
            ``DistributedModelParallel`` materialises and initialises the TTM tables (its
            ``init_parameters``), or call :meth:`reset_parameters` after ``to_empty``).
        validate_inputs: check every id against its table (an error names the feature
            and the value) and the KJT's layout (integer ids and lengths; lengths,
            offsets and values that agree); a few vectorised ops per batch.
        allow_extra_keys: ignore KJT keys that no table reads (TorchRec's behaviour);
            when ``False`` they are an error.
        plans: explicit per-table decisions (``compress`` passes them); overrides ``policy``.

    Attributes:
        static_shapes: capturable forward for CUDA graphs (``False`` by default; set by
            :func:`comera_rec.tensor.set_static_shapes`, which also switches the groups):
            no host synchronisation and shapes fixed by the input's shapes and its
            (host) ``length_per_key``. Validation is skipped whatever
            ``validate_inputs`` says (it reads ids on the host). The input KJT should
            carry ``length_per_key`` / ``offset_per_key`` already computed, or they are
            computed here with a synchronisation.

    Example::

        >>> tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50_000,
        ...                              feature_names=["f0"]),
        ...           EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=100,
        ...                              feature_names=["f1"])]
        >>> ebc = TTMEmbeddingBagCollection(tables, CompressionPolicy(rank=8))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["f0", "f1"], values=torch.tensor([1, 49_999, 3]), lengths=torch.tensor([2, 0, 1, 0]))
        >>> out = ebc(kjt)
        >>> out.keys(), out.values().shape
        (['f0', 'f1'], torch.Size([2, 16]))
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        policy: CompressionPolicy | None = None,
        *,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        validate_inputs: bool = True,
        allow_extra_keys: bool = False,
        plans: Mapping[str, TablePlan] | None = None,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("TTMEmbeddingBagCollection: need at least one table config")
        policy = policy or CompressionPolicy()
        self.policy = policy
        self._is_weighted = is_weighted
        self._validate = validate_inputs
        self._allow_extra_keys = allow_extra_keys
        self.static_shapes = False
        # per group, (table index, is mean) of each stream as device tensors, made once per
        # device: no per-step host-to-device copy, and nothing a captured graph could not read
        self._stream_constants: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._embedding_bag_configs = tables

        distinct_table_names("TTMEmbeddingBagCollection", tables)
        for t in tables:
            if t.pooling not in _POOLINGS:
                raise ValueError(
                    f"TTMEmbeddingBagCollection: table {t.name!r} has pooling {t.pooling}; "
                    f"only SUM and MEAN are supported"
                )
        self._plan_tables("TTMEmbeddingBagCollection", tables, policy, plans)

        # ---- dense tables: one TorchRec EBC, sharded by TorchRec under DMP
        dense_configs = [t for t in tables if not self.plans[t.name].compressed]
        self.dense: EmbeddingBagCollection | None = (
            EmbeddingBagCollection(dense_configs, is_weighted=is_weighted, device=self._device)
            if dense_configs
            else None
        )
        self._dense_features: list[str] = list(OrderedDict.fromkeys(f for t in dense_configs for f in t.feature_names))
        self._dense_lengths: list[int] = [t.embedding_dim for t in dense_configs for _ in t.feature_names]

        # ---- compressed tables: stacked by TT shape; per group, (feature name, table index in
        # the stack, is mean) for every bag stream
        self._group_streams: list[list[tuple[str, int, bool]]] = [
            [(f, i, t.pooling == PoolingType.MEAN) for i, t in enumerate(members) for f in t.feature_names]
            for members in self._stack_compressed(tables)
        ]

        # ---- where each output key comes from, in TorchRec's order
        self._layout = BagOutputLayout.from_tables(tables, self.plans, self._group_tables, self._group_streams)

        self._init_key_checks(tables)

    # ------------------------------------------------------------------ interface
    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, as given."""
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        """Whether the input KJT's weights are used as per-sample weights."""
        return self._is_weighted

    def reset_parameters(self) -> None:
        """(Re)initialise all tables; a no-op for tensors still on the meta device."""
        for group in self.groups:
            group.reset_parameters()
        if self.dense is not None:
            self.dense.reset_parameters()

    def _table_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def _dense_modules(self) -> Mapping[str, nn.Module]:
        return self.dense.embedding_bags if self.dense is not None else {}

    def extra_repr(self) -> str:
        return f"compressed={self.compressed_tables()}, dense={self.dense_tables()}, is_weighted={self._is_weighted}"

    # ------------------------------------------------------------------ forward
    def _direct_dense_lookup(self) -> nn.Module | None:
        """The dense tables' one table-batched lookup, when it can be called directly.

        ``FusedEmbeddingBagCollection.forward`` splits its input into one JaggedTensor per
        feature and concatenates them again (~1 ms a step for the Kaggle model's 16 small
        tables); when ``self.dense`` is a plain (unsharded) one with a single lookup whose
        features come in this collection's dense-feature order, the ids are handed to that
        lookup as the collection already has them (:func:`fused_tables_lookup`: the fused
        CPU row-wise Adagrad kernel on the lookup's own buffers, or the same FBGEMM call).
        Sharded (DMP) or otherwise, ``self.dense`` is called as it is.
        """
        return single_lookup(self.dense, self._dense_features)

    def _plain_dense_pooled(
        self, stream: Callable[[str], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    ) -> list[torch.Tensor]:
        """The dense tables' pooled ``(B, D)`` bags, one per (table, feature) in the order of
        the dense child's output, each by its ``nn.EmbeddingBag`` called as TorchRec's
        ``EmbeddingBagCollection.forward`` calls it, on ``stream(feature)``'s slices.

        For a plain (unsharded, unfused) child: its forward would split the KJT into one
        JaggedTensor per feature and concatenate the outputs again, most of a scoring
        batch's time at a few rows.
        """
        assert self.dense is not None
        merged = self._merged_dense_tables()
        if merged is not None:
            return self._merged_dense_pooled(merged, stream)
        pieces: list[torch.Tensor] = []
        for config, bag in zip(self.dense.embedding_bag_configs(), self.dense.embedding_bags.values()):
            for feature in config.feature_names:
                ids, lengths, weights = stream(feature)
                offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
                pooled = bag(input=ids, offsets=offsets, per_sample_weights=weights if self._is_weighted else None)
                pieces.append(pooled.float())
        return pieces

    def _merged_dense_tables(self) -> tuple[torch.Tensor, torch.Tensor, str] | None:
        """``(weights (sum of rows, D), first row of each (table, feature) piece (P,), mode)``:
        the plain dense child's tables stacked into one, kept while scoring inside
        :func:`~comera_rec.tensor.cached_weights`, so that a batch pools every dense feature
        in one ``embedding_bag`` call (one call per table was most of a one-row batch's
        dense lookup). ``None`` where that does not apply: gradients on, outside the scope,
        tables of different pooling modes or dims, bags with options of their own, or
        tables larger in all than :data:`STACKED_DENSE_MAX_BYTES` (the copy would be a
        second set of them in memory)."""
        assert self.dense is not None
        if not scoring_cache_on():
            return None
        bags = list(self.dense.embedding_bags.values())
        weights = [bag.weight for bag in bags]
        modes = {bag.mode for bag in bags}
        cache = derived_cache(self, "dense_tables")
        kept = cache.peek(weights)
        if kept is not None and modes == {kept[2]} and self._plain_bags(bags):  # type: ignore[index]
            return kept  # type: ignore[return-value]
        if (
            not bags
            or not cache_applies(weights)
            or not self._plain_bags(bags)
            or len(modes) != 1
            or len({w.shape[1] for w in weights}) != 1
            or len({(w.dtype, w.device) for w in weights}) != 1
            or sum(w.numel() * w.element_size() for w in weights) > STACKED_DENSE_MAX_BYTES
        ):
            return None

        def stack() -> tuple[torch.Tensor, torch.Tensor, str]:
            configs = self.dense.embedding_bag_configs()  # type: ignore[union-attr]
            firsts, row = [], 0
            for config, weight in zip(configs, weights):
                firsts += [row] * len(config.feature_names)
                row += weight.shape[0]
            return torch.cat(weights), torch.tensor(firsts, device=weights[0].device), next(iter(modes))

        return cache.get(weights, stack)

    @staticmethod
    def _plain_bags(bags: list[nn.Module]) -> bool:
        """Whether each bag is a plain ``nn.EmbeddingBag`` without options of its own (one
        ``embedding_bag`` call over their stacked weights pools as they would)."""
        return all(type(bag) is nn.EmbeddingBag and bag.max_norm is None and bag.padding_idx is None for bag in bags)

    def _merged_dense_pooled(
        self,
        merged: tuple[torch.Tensor, torch.Tensor, str],
        stream: Callable[[str], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    ) -> list[torch.Tensor]:
        """:meth:`_plain_dense_pooled` over the stacked tables of :meth:`_merged_dense_tables`:
        each piece's ids moved to its table's rows, one ``embedding_bag`` for all."""
        weight, firsts, mode = merged
        assert self.dense is not None
        parts = [stream(f) for config in self.dense.embedding_bag_configs() for f in config.feature_names]
        counts = torch.tensor([p[0].numel() for p in parts], device=firsts.device)
        ids = torch.cat([p[0] for p in parts]).long() + torch.repeat_interleave(firsts, counts)
        lengths = torch.cat([p[1] for p in parts])
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        weights = torch.cat([p[2] for p in parts]) if self._is_weighted else None  # type: ignore[misc]
        pooled = F.embedding_bag(
            ids, weight, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True
        )  # (P * B, D)
        batch = lengths.numel() // len(parts)  # bags per feature (an empty batch has none)
        return list(pooled.float().view(len(parts), batch, weight.shape[1]).unbind(0))

    def _stream_constants_on(self, group: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table index (S,), is mean (S,))`` of the group's streams on ``device``.

        Made on first use and kept, so a forward (captured or not) reads tensors that
        outlive it and does no host-to-device copy.
        """
        key = (group, device)
        hit = self._stream_constants.get(key)
        if hit is None:
            streams = self._group_streams[group]
            hit = (
                torch.tensor([t for _, t, _ in streams], device=device),
                torch.tensor([m for _, _, m in streams], device=device),
            )
            self._stream_constants[key] = hit
        return hit

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature's bags with its tables.

        Args:
            features: a KJT holding at least every feature the tables read, one bag per
                sample and feature (stride ``B``); or of variable batch sizes per feature
                with ``inverse_indices`` (TorchRec's VBE), taken as the KJT of ``B`` samples
                it stands for (:func:`one_batch_size`; not with sharded dense tables).

        Returns:
            A ``KeyedTensor`` of values ``(B, sum of embedding dims)``, keys and
            ``length_per_key`` as TorchRec's ``EmbeddingBagCollection``.

        Under TorchRec's train pipelines: a sharded ``dense`` child (DMP) is called on
        ``features`` itself, the KJT this collection is given, so the pipeline's trace
        finds its input in the batch and runs its input distribution ahead, as for any
        sharded ``EmbeddingBagCollection``; the checks and the TTM lookups trace as one
        call each (:func:`fx_opaque`).
        """
        self._release_in_backward()  # marked after the model was moved (no DMP): see _apply
        if isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
            features = self._one_batch_size(features)
        fx_opaque(self, "_check_features", features)  # before any table reads an id
        # sharded: the whole KJT, in eager runs as in the pipeline (a sharded EBC picks its
        # features; its input dist is set up for the keys of its first input)
        dense_out = self.dense(features) if isinstance(self.dense, ShardedModule) else None
        return fx_opaque(self, "_pool", features, dense_out)  # type: ignore[return-value]

    def _one_batch_size(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """A KJT of variable batch sizes per feature (VBE) as the one of one batch size it
        stands for (:func:`one_batch_size`): its samples' bags, repeated where samples share
        one. A sharded ``dense`` child takes the batch's KJT as it is (its input distribution
        runs ahead, in the train pipelines), so VBE is refused with one."""
        if isinstance(self.dense, ShardedModule):
            raise ValueError(
                f"{COLLECTION_NAME}: variable batch sizes per feature (VBE) with sharded dense tables are not "
                "supported; compress every table of this collection, or give it one batch size per feature"
            )
        return one_batch_size(features)

    def _check_features(self, features: KeyedJaggedTensor) -> None:
        """The input's type, layout and (if ``validate_inputs``) ids; see :meth:`forward`."""
        check_input_kind(features, self.dense)
        keys = features.keys()
        _, bounds = self._key_layout(keys)
        values = features.values()
        lengths = features.lengths()
        validate = self._validate and not self.static_shapes  # validation reads ids on the host
        if validate:
            check_jagged_batch(features, keys, values, lengths, bounds, self._bounds)

    def _group_inputs(
        self,
        g: int,
        stream: Callable[[str], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        weighted: bool,
        batch: int,
        ids_of_key: Callable[[str], int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """TTM group ``g``'s lookup inputs: ``(ids, lengths, offsets, trains, weights)``,
        its streams' bags one after the other (``ids_of_key(f)``: feature ``f``'s id count,
        from the host's lengths per key)."""
        streams = self._group_streams[g]
        parts = [stream(f) for f, _, _ in streams]
        ids = torch.cat([p[0] for p in parts]).long()
        lens = torch.cat([p[1] for p in parts]).long()
        w = torch.cat([p[2] for p in parts]) if weighted else None  # type: ignore[misc]
        stream_train, _ = self._stream_constants_on(g, ids.device)
        # (N_g,): each id's table. A stream's ids are contiguous: on the host, its table
        # repeats once per id of the stream (from the host lengths per key, one repeat
        # per stream); static shapes / devices repeat per bag from device tensors (no
        # tensor from Python data: capturable in a CUDA graph)
        if ids.device.type == "cpu" and not self.static_shapes:
            ids_per_stream = torch.tensor([ids_of_key(f) for f, _, _ in streams])
            trains = torch.repeat_interleave(stream_train, ids_per_stream, output_size=ids.numel())
        else:
            trains = torch.repeat_interleave(
                stream_train.unsqueeze(1).expand(-1, batch).reshape(-1), lens, output_size=ids.numel()
            )
        offsets = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
        return ids, lens, offsets, trains, w

    def _lookups_write_in_place(self, values: torch.Tensor, dense_lookup: nn.Module | None) -> bool:
        """Whether every lookup can write its bags into the output itself (no gather after):
        training on CPU through the fused kernels (float32 TTM cores, sum pooling), the
        dense tables (if any) through their one table-batched lookup ``dense_lookup``
        (:meth:`_direct_dense_lookup`). Scoring keeps its cached halves and the gather."""
        if not torch.is_grad_enabled() or self.static_shapes or values.device.type != "cpu":
            return False
        if any(mean for streams in self._group_streams for _, _, mean in streams):
            return False
        if self.dense is not None and dense_lookup is None:
            return False
        return all(
            group.cores[0].dtype == torch.float32 and kernels.cpu_kernel_applies(list(group.cores), values)
            for group in self.groups
        )

    def _direct_dense_values(
        self,
        lookup: nn.Module,
        stream: Callable[[str], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        weighted: bool,
        batch: int,
        out_columns: tuple[int, list[int]] | None = None,
    ) -> torch.Tensor:
        """The dense tables' pooled values through their one table-batched ``lookup``
        (:meth:`_direct_dense_lookup`), the ids handed over as this collection has them."""
        parts = [stream(f) for f in self._dense_features]
        ids = torch.cat([p[0] for p in parts])
        w = torch.cat([p[2] for p in parts]) if weighted else None  # type: ignore[misc]
        return fused_tables_lookup(lookup, ids, torch.cat([p[1] for p in parts]), w, batch, out_columns=out_columns)

    def _pool_in_place(
        self,
        stream: Callable[[str], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        weighted: bool,
        batch: int,
        ids_of_key: Callable[[str], int],
        dense_lookup: nn.Module | None,
    ) -> KeyedTensor:
        """:meth:`_pool` with every lookup writing its bags into the ``(B, width)`` output at
        their keys' columns (:meth:`_lookups_write_in_place`): the dense tables' lookup makes
        the output, each TTM group writes its columns into it, and in backward each reads
        its columns of the one gradient. The gather's pass over the output and its
        gradient's pass back are not made."""
        layout = self._layout
        width = sum(layout.lengths_per_embedding)
        dense_cols, group_cols = layout.stream_columns(len(self.groups))
        if dense_lookup is not None:
            out = self._direct_dense_values(dense_lookup, stream, weighted, batch, out_columns=(width, dense_cols))
        else:  # every column is a TTM group's
            out = torch.empty(batch, width)
        for g, group in enumerate(self.groups):
            ids, _, offsets, trains, w = self._group_inputs(g, stream, weighted, batch, ids_of_key)
            out = group.forward_into(out, group_cols[g], ids, offsets, trains, w, stream_batch=batch)
        return KeyedTensor(
            keys=list(layout.embedding_names), values=out, length_per_key=list(layout.lengths_per_embedding)
        )

    def _pool(self, features: KeyedJaggedTensor, dense_out: object) -> KeyedTensor:
        """:meth:`forward` after the checks; ``dense_out`` is the sharded ``dense`` child's
        output for ``features`` (``None`` when ``dense`` is unsharded or absent)."""
        keys = features.keys()
        index, _ = self._key_layout(keys)
        values = features.values()
        lengths = features.lengths()
        length_per_key = features.length_per_key()
        offset_per_key = features.offset_per_key()
        batch = features.stride()
        weights = features.weights_or_none() if self._is_weighted else None
        if self._is_weighted and weights is None:
            raise ValueError("TTMEmbeddingBagCollection: is_weighted=True but the KeyedJaggedTensor has no weights")

        # every key's slices made by three calls, not three per key (a one-row batch's time
        # is mostly such calls), where the values hold exactly the keys' ids
        by_key = batch > 0 and offset_per_key[-1] == values.numel() and lengths.numel() == len(keys) * batch
        key_values = values.split(length_per_key) if by_key else ()
        key_lengths = lengths.view(len(keys), batch).unbind(0) if by_key else ()
        key_weights = weights.split(length_per_key) if by_key and weights is not None else None

        def stream(feature: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            i = index[feature]
            if by_key:
                return key_values[i], key_lengths[i], key_weights[i] if key_weights is not None else None
            lo, hi = offset_per_key[i], offset_per_key[i + 1]
            w = weights[lo:hi] if weights is not None else None
            return values[lo:hi], lengths[i * batch : (i + 1) * batch], w

        # On CPU with the fused kernel, every part comes as (B, streams * D) and one pass
        # gathers the output's blocks from them (gather_column_blocks), except in training,
        # where the lookups write into the output themselves (_pool_in_place); otherwise
        # the parts are split per stream and concatenated.
        layout = self._layout
        by_blocks = layout.uniform_dim and values.device.type == "cpu" and kernels.cpu_kernel_enabled()

        def ids_of_key(feature: str) -> int:
            return length_per_key[index[feature]]

        # the dense tables' one table-batched lookup, when they are unsharded and fused
        dense_lookup = self._direct_dense_lookup() if self.dense is not None and dense_out is None else None
        if by_blocks and dense_out is None and self._lookups_write_in_place(values, dense_lookup):
            return self._pool_in_place(stream, weights is not None, batch, ids_of_key, dense_lookup)
        pooled_tt: list[tuple[torch.Tensor, ...]] = []  # per group: F_g tensors (B, D)
        sources: list[torch.Tensor] = []  # by_blocks: dense values (if any), then each group's (B, F_g * D)
        for g, group in enumerate(self.groups):
            ids, lens, offsets, trains, w = self._group_inputs(g, stream, weights is not None, batch, ids_of_key)
            _, stream_mean = self._stream_constants_on(g, ids.device)
            streams = self._group_streams[g]
            out = group(ids, offsets, trains, w, stream_batch=batch if by_blocks else 0)
            if any(mean for _, _, mean in streams):
                is_mean = stream_mean.unsqueeze(1).expand(-1, batch).reshape(-1)  # (F_g * B,)
                divisor = torch.where(is_mean, lens.clamp_min(1), torch.ones_like(lens))
                out = divide_bags(out, divisor, batch if by_blocks else 0)
            if by_blocks:
                sources.append(out)
            else:
                # unbind, not one select per stream: its backward is one stack per group, where
                # each select would zero-fill a group-sized gradient
                pooled_tt.append(out.view(len(streams), batch, -1).unbind(0))

        dense_parts: list[torch.Tensor] = []
        dense_pieces: list[torch.Tensor] | None = None  # the plain EBC's outputs, one per (table, feature)
        if dense_out is not None:
            kt = dense_out
            if not isinstance(kt, KeyedTensor) and hasattr(kt, "wait"):
                kt = kt.wait()  # sharded under DMP: an awaitable KeyedTensor
            dense_values = kt.values()  # type: ignore[attr-defined]
        elif type(self.dense) is EmbeddingBagCollection and by_blocks:
            # a plain, unsharded EBC: its bags called on this collection's own slices, each
            # (B, D) output a source of the gather below (no KJT split, no concatenation)
            dense_pieces = self._plain_dense_pooled(stream)
        elif self.dense is not None:
            if dense_lookup is not None:
                dense_values = self._direct_dense_values(dense_lookup, stream, weights is not None, batch)
            else:
                parts = [stream(f) for f in self._dense_features]
                # hand the (host) lengths per key on, or TorchRec computes them again (a sync on GPU)
                sub = KeyedJaggedTensor(
                    keys=self._dense_features,
                    values=torch.cat([p[0] for p in parts]),
                    lengths=torch.cat([p[1] for p in parts]),
                    weights=torch.cat([p[2] for p in parts]) if weights is not None else None,  # type: ignore[misc]
                    stride=batch,
                    length_per_key=[length_per_key[index[f]] for f in self._dense_features],
                )
                kt = self.dense(sub)
                if not isinstance(kt, KeyedTensor) and hasattr(kt, "wait"):
                    kt = kt.wait()
                dense_values = kt.values()
        if self.dense is not None and dense_pieces is None:
            if by_blocks:
                sources.insert(0, dense_values)
            else:
                dense_parts = list(dense_values.split(self._dense_lengths, dim=1))

        if by_blocks:
            blocks = layout.column_blocks(self.dense is not None)
            if dense_pieces is not None:  # source 0's block at column c is piece c / D, from column 0
                dim = layout.lengths_per_embedding[0]
                blocks = [(col // dim, 0) if s == 0 else (s + len(dense_pieces) - 1, col) for s, col in blocks]
                sources[:0] = dense_pieces
            out_values = kernels.gather_column_blocks(
                [v.float() for v in sources], blocks, layout.lengths_per_embedding[0]
            )
        else:
            pieces = [pooled_tt[a][b] if kind == "tt" else dense_parts[a] for kind, a, b in layout.slots]
            out_values = torch.cat(pieces, dim=1).float()
        return KeyedTensor(
            keys=list(layout.embedding_names),
            values=out_values,
            length_per_key=list(layout.lengths_per_embedding),
        )

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_embedding_bag_collection(
        cls,
        ebc: EmbeddingBagCollectionInterface,
        policy: CompressionPolicy | None = None,
        *,
        validate_inputs: bool = True,
        allow_extra_keys: bool = True,
    ) -> "TTMEmbeddingBagCollection":
        """Convert a TorchRec collection, initialising TTM tables from its weights by TT-SVD.

        Dense tables keep their weights. At full rank the result computes the same
        embeddings (to float tolerance).

        Example::

            >>> ebc = EmbeddingBagCollection([EmbeddingBagConfig(
            ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
            >>> ttm = TTMEmbeddingBagCollection.from_embedding_bag_collection(
            ...     ebc, CompressionPolicy(rank=64, min_rows_to_compress=0, min_params_to_compress=0, min_gain=0.0))
            >>> ttm.compressed_tables()
            ['t']
        """
        tables = ebc.embedding_bag_configs()
        weights = {name: bag.weight.detach() for name, bag in getattr(ebc, "embedding_bags", {}).items()}
        missing = [t.name for t in tables if t.name not in weights]
        if missing:
            raise ValueError(f"from_embedding_bag_collection: no weights found for tables {missing}")
        out = cls(
            tables,
            policy,
            is_weighted=ebc.is_weighted(),
            device="meta",
            validate_inputs=validate_inputs,
            allow_extra_keys=allow_extra_keys,
        )
        device = next(iter(weights.values())).device
        for g, members in enumerate(out._group_tables):
            old = out.groups[g]
            out.groups[g] = StackedTTMTables.from_embeddings(
                [weights[n] for n in members],
                list(old.ranks),
                row_shape=old.row_shape,
                col_shape=old.col_shape,
            ).to(device)
        if out.dense is not None:
            out.dense = EmbeddingBagCollection(
                out.dense.embedding_bag_configs(), is_weighted=ebc.is_weighted(), device=device
            )
            with torch.no_grad():
                for name, bag in out.dense.embedding_bags.items():
                    bag.weight.copy_(weights[name])
            for name, bag in out.dense.embedding_bags.items():  # the sharder fuses the user's optimiser
                carry_in_backward_optimizers(ebc.embedding_bags[name].weight, bag.weight)
        out._device = device
        return out
