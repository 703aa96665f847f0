"""TTMEmbeddingCollection: a drop-in TorchRec EmbeddingCollection with TTM tables.

The unpooled counterpart of :class:`~comera_rec.integration.collection.TTMEmbeddingBagCollection`
for sequence models (BERT4Rec, SASRec, retrieval towers): one embedding per id, returned
as TorchRec's ``Dict[str, JaggedTensor]``. Large tables are TTM tensor trains stacked by
TT shape (the same :class:`~comera_rec.integration.policy.CompressionPolicy` and plan as
the bag collection); small tables stay dense in a TorchRec ``EmbeddingCollection``
submodule (``dense``), which TorchRec's ``EmbeddingCollectionSharder`` shards under
``DistributedModelParallel``. The per-id lookup of the TTM groups,
:func:`~comera_rec.integration.row_lookup.ttm_lookup_rows`, is in :mod:`.row_lookup`.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

import torch
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingCollection,
    EmbeddingCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from comera_rec.integration.collection import fx_opaque
from comera_rec.integration.in_backward import carry_in_backward_optimizers
from comera_rec.integration.policy import CompressionPolicy, TablePlan
from comera_rec.integration.row_lookup import ttm_lookup_rows  # importable from here too
from comera_rec.integration.table_groups import TTMTableGroups, distinct_table_names
from comera_rec.tensor import kernels
from comera_rec.tensor.stacked import StackedTTMTables

# the checks and lookups are one node each when TorchRec's train pipelines FX-trace the model
torch.fx.wrap("fx_opaque")

_NAME = "TTMEmbeddingCollection"


class TTMEmbeddingCollection(TTMTableGroups, EmbeddingCollectionInterface):
    """An ``EmbeddingCollection`` (per-id, unpooled embeddings) whose large tables are TTM tensor trains.

    Output keys and their order, each ``JaggedTensor``'s lengths (hence offsets) and,
    with ``need_indices``, its weights (the ids) are those of TorchRec's
    ``EmbeddingCollection`` for the same configs (a feature read by several tables is
    named ``feature@table``). The ``policy`` decides per table whether it is compressed,
    at which rank and shape, exactly as for
    :class:`~comera_rec.integration.collection.TTMEmbeddingBagCollection`; the others stay
    dense in the ``dense`` submodule (TorchRec's ``EmbeddingCollection``). Compressed
    tables of equal TT shape form one :class:`~comera_rec.tensor.stacked.StackedTTMTables`
    in ``groups``; all ids of a group are looked up in one de-duplicated call
    (:func:`ttm_lookup_rows`).

    Args:
        tables: the table configs (``EmbeddingConfig``; one ``embedding_dim`` for all,
            as TorchRec requires; compressed tables must be FP32).
        policy: what to compress; ``CompressionPolicy()`` when ``None``.
        device: where to allocate (``"meta"`` allocates nothing; TorchRec's
            ``DistributedModelParallel`` materialises and initialises the TTM tables, or
            call :meth:`reset_parameters` after ``to_empty``).
        need_indices: return each feature's ids as its ``JaggedTensor``'s weights
            (TorchRec's ``need_indices``).
        validate_inputs: check the KJT's layout and every id against its table (an error
            names the feature, the value and the table).
        allow_extra_keys: ignore KJT keys that no table reads (TorchRec's behaviour);
            when ``False`` they are an error.
        plans: explicit per-table decisions (:class:`TablePlan` by table name); override ``policy``.

    Attributes:
        static_shapes: look up without de-duplication (set by
            :func:`comera_rec.tensor.set_static_shapes`); validation is skipped then. The
            input KJT should carry ``length_per_key`` already, or splitting it per
            feature synchronises with the device.

    Example::

        >>> tables = [EmbeddingConfig(name="item", embedding_dim=8, num_embeddings=50_000,
        ...                           feature_names=["history", "target"]),
        ...           EmbeddingConfig(name="genre", embedding_dim=8, num_embeddings=20,
        ...                           feature_names=["genre"])]
        >>> ec = TTMEmbeddingCollection(tables, CompressionPolicy(rank=8, min_params_to_compress=0))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["history", "target", "genre"], values=torch.tensor([1, 49_999, 7, 3, 2]),
        ...     lengths=torch.tensor([2, 1, 1, 0, 1, 0]))
        >>> out = ec(kjt)
        >>> list(out), out["history"].values().shape, out["history"].lengths().tolist()
        (['history', 'target', 'genre'], torch.Size([3, 8]), [2, 1])
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        policy: CompressionPolicy | None = None,
        *,
        device: torch.device | str | None = None,
        need_indices: bool = False,
        validate_inputs: bool = True,
        allow_extra_keys: bool = False,
        plans: Mapping[str, TablePlan] | None = None,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError(f"{_NAME}: need at least one table config")
        for t in tables:
            if isinstance(t, EmbeddingBagConfig):
                raise TypeError(
                    f"{_NAME}: table {t.name!r} is an EmbeddingBagConfig (pooled); use EmbeddingConfig here, "
                    f"or TTMEmbeddingBagCollection for pooled bags"
                )
            if not isinstance(t, EmbeddingConfig):
                raise TypeError(f"{_NAME}: tables must be EmbeddingConfig, got {type(t).__name__}")
        names = distinct_table_names(_NAME, tables)
        dims = {t.name: t.embedding_dim for t in tables}
        if len(set(dims.values())) != 1:
            raise ValueError(f"{_NAME}: all tables need one embedding_dim (as in TorchRec), got {dims}")
        policy = policy or CompressionPolicy()
        self.policy = policy
        self._need_indices = need_indices
        self._validate = validate_inputs
        self._allow_extra_keys = allow_extra_keys
        self.static_shapes = False
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._embedding_configs = tables
        self._embedding_dim = tables[0].embedding_dim
        self._plan_tables(_NAME, tables, policy, plans)

        # ---- dense tables: TorchRec's own collection, sharded by its sharder under DMP
        dense_configs = [t for t in tables if not self.plans[t.name].compressed]
        self.dense: EmbeddingCollection | None = (
            EmbeddingCollection(dense_configs, device=self._device, need_indices=need_indices)
            if dense_configs
            else None
        )

        # the dense child names its outputs among its own tables only ("f" where this
        # collection says "f@table" for a feature shared with a TTM table)
        self._dense_names: dict[str, str] = {}
        if self.dense is not None:
            full_names = dict(zip(names, get_embedding_names_by_table(tables)))
            for t, own in zip(dense_configs, self.dense.embedding_names_by_table()):
                self._dense_names.update(zip(own, full_names[t.name]))

        # ---- compressed tables: stacked by TT shape; per group, (output name, feature name,
        # table index in the stack) of every stream
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        output_names = dict(zip(names, self._embedding_names_by_table))
        self._group_streams: list[list[tuple[str, str, int]]] = [
            [(e, f, i) for i, t in enumerate(members) for e, f in zip(output_names[t.name], t.feature_names)]
            for members in self._stack_compressed(tables)
        ]
        self._embedding_names: list[str] = list(itertools.chain(*self._embedding_names_by_table))

        self._init_key_checks(tables)

    # ------------------------------------------------------------------ interface
    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The table configs, as given."""
        return self._embedding_configs

    def need_indices(self) -> bool:
        """Whether each output ``JaggedTensor`` carries its ids as weights."""
        return self._need_indices

    def embedding_dim(self) -> int:
        """The embedding dimension (one for all tables)."""
        return self._embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        """Output keys per table, as TorchRec names them (``feature@table`` when shared)."""
        return self._embedding_names_by_table

    def reset_parameters(self) -> None:
        """(Re)initialise all tables; a no-op for tensors still on the meta device."""
        for group in self.groups:
            group.reset_parameters()
        if self.dense is not None:
            # each config's init_fn, as TorchRec's reset_parameters, which is a no-op for a
            # collection built on meta even once ``to_empty`` has allocated it
            configs = {t.name: t for t in self._embedding_configs}
            with torch.no_grad():
                for name, emb in self.dense.embeddings.items():
                    if emb.weight.is_meta:
                        continue
                    init = configs[name].init_fn
                    if init is not None:
                        init(emb.weight)
                    else:
                        emb.reset_parameters()

    def _table_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def _dense_modules(self) -> Mapping[str, nn.Module]:
        return self.dense.embeddings if self.dense is not None else {}

    def extra_repr(self) -> str:
        return f"compressed={self.compressed_tables()}, dense={self.dense_tables()}, need_indices={self._need_indices}"

    # ------------------------------------------------------------------ checks
    def _key_bounds(self, keys: Sequence[str]) -> list[int]:
        """Per KJT key, the id bound (-1: read by no table); missing or extra keys raise."""
        return self._key_layout(keys)[1]

    def _check_features(self, features: KeyedJaggedTensor) -> None:
        """The input's type and keys; with ``validate_inputs``, its layout and ids."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"{_NAME}: expected a KeyedJaggedTensor, got {type(features).__name__}")
        if features.variable_stride_per_key():
            raise ValueError(f"{_NAME}: variable batch sizes per feature are not supported")
        keys = features.keys()
        bounds = self._key_bounds(keys)
        if not self._validate or self.static_shapes:  # validation reads ids on the host
            return
        values, lengths, batch = features.values(), features.lengths(), features.stride()
        for what, t in (("values (ids)", values), ("lengths", lengths)):
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise TypeError(f"{_NAME}: KeyedJaggedTensor {what} must be an integer tensor, got {t.dtype}")
        if lengths.numel() != len(keys) * batch:
            raise ValueError(
                f"{_NAME}: KeyedJaggedTensor has {lengths.numel()} lengths, expected "
                f"{len(keys)} keys x batch {batch} = {len(keys) * batch}"
            )
        if values.device.type == "cpu" and lengths.device.type == "cpu" and kernels.cpu_kernel_enabled():
            code, pos, total, key = kernels.check_jagged(values, lengths, None, batch, bounds)  # one C++ pass
        else:
            code, pos, total, key = self._check_with_torch(features, values, lengths, bounds)
        if code == 1:
            raise ValueError(
                f"{_NAME}: negative length {int(lengths[pos])} at feature {keys[key]!r}, sample {pos % batch}"
            )
        if total != values.numel():
            raise ValueError(
                f"{_NAME}: KeyedJaggedTensor lengths sum to {total} but it holds {values.numel()} values (ids)"
            )
        if code == 3:
            num, table = self._bounds[keys[key]]
            raise ValueError(
                f"{_NAME}: feature {keys[key]!r} has id {int(values[pos])} out of range [0, {num}) of table {table!r}"
            )

    @staticmethod
    def _check_with_torch(
        features: KeyedJaggedTensor, values: torch.Tensor, lengths: torch.Tensor, bounds: list[int]
    ) -> tuple[int, int, int, int]:
        """:func:`kernels.check_jagged`'s ``(code, position, total, key)`` by tensor ops
        (devices other than the CPU, or the kernels off)."""
        batch = features.stride()
        negative = (lengths < 0).nonzero()
        if negative.numel():
            pos = int(negative[0])
            return 1, pos, 0, pos // max(batch, 1)
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != values.numel() or not values.numel():
            return 0, -1, total, -1
        per_key = lengths.view(len(bounds), batch).sum(1) if batch else lengths.new_zeros(len(bounds))
        limit = torch.repeat_interleave(torch.tensor(bounds, device=values.device), per_key.to(values.device))
        bad = ((values < 0) | (values >= limit)) & (limit >= 0)
        if bool(bad.any()):
            pos = int(bad.nonzero()[0])
            key = int(torch.searchsorted(torch.cumsum(per_key, 0).to(values.device), pos, right=True))
            return 3, pos, total, key
        return 0, -1, total, -1

    # ------------------------------------------------------------------ forward
    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Look up every id of every feature with its tables.

        Args:
            features: a KJT holding at least every feature the tables read.

        Returns:
            ``{embedding name: JaggedTensor}`` in TorchRec's order: values
            ``(ids of the feature, embedding_dim)`` (float32), the feature's lengths, and
            with ``need_indices`` its ids as weights.

        A sharded ``dense`` child (DMP) is called on ``features`` itself, as the bag
        collection does, so TorchRec's train pipelines find its input in the batch; the
        checks and the TTM lookups trace as one call each.
        """
        self._release_in_backward()  # marked after the model was moved (no DMP): see _apply
        fx_opaque(self, "_check_features", features)
        dense_out = self.dense(features) if isinstance(self.dense, ShardedModule) else None
        return fx_opaque(self, "_lookup", features, dense_out)  # type: ignore[return-value]

    def _lookup(self, features: KeyedJaggedTensor, dense_out: object) -> dict[str, JaggedTensor]:
        """:meth:`forward` after the checks; ``dense_out`` is the sharded ``dense`` child's
        output for ``features`` (``None`` when ``dense`` is unsharded or absent)."""
        jts = features.to_dict()  # TorchRec's own split: the lengths its EmbeddingCollection returns
        out: dict[str, JaggedTensor] = {}
        for group, streams in zip(self.groups, self._group_streams):
            parts = [jts[f].values() for _, f, _ in streams]
            counts = [p.numel() for p in parts]
            ids = torch.cat(parts)
            trains = torch.repeat_interleave(
                torch.tensor([i for _, _, i in streams], device=ids.device),
                torch.tensor(counts, device=ids.device),
                output_size=ids.numel(),
            )
            rows = ttm_lookup_rows(
                group.scaled_cores(),
                group.row_shape,
                group.embedding_dim,
                ids,
                trains,
                static_shapes=self.static_shapes,
            ).float()
            for (name, f, _), values in zip(streams, rows.split(counts)):
                jt = jts[f]
                out[name] = JaggedTensor(
                    values=values, lengths=jt.lengths(), weights=jt.values() if self._need_indices else None
                )
        if self.dense is not None:
            dense = dense_out if dense_out is not None else self.dense(features)
            if not isinstance(dense, dict) and hasattr(dense, "wait"):
                dense = dense.wait()  # sharded under DMP: an awaitable dict
            for own, jt in dense.items():  # type: ignore[union-attr]
                out[self._dense_names[own]] = jt
        return {name: out[name] for name in self._embedding_names}  # TorchRec's order

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_embedding_collection(
        cls,
        ec: EmbeddingCollectionInterface,
        policy: CompressionPolicy | None = None,
        *,
        validate_inputs: bool = True,
        allow_extra_keys: bool = True,
    ) -> "TTMEmbeddingCollection":
        """Convert a TorchRec ``EmbeddingCollection``, initialising TTM tables from its
        weights by TT-SVD (a model built on ``meta`` gets the fresh init instead).

        Dense tables keep their weights (and in-backward optimisers). At full rank the
        result computes the same embeddings (to float tolerance).

        Args:
            ec: the collection (its ``embeddings`` hold one ``nn.Embedding`` per table).
            policy: what to compress; ``CompressionPolicy()`` when ``None``.
            validate_inputs: see the class.
            allow_extra_keys: see the class (``True``: TorchRec's behaviour).

        Example::

            >>> ec = EmbeddingCollection([EmbeddingConfig(
            ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
            >>> ttm = TTMEmbeddingCollection.from_embedding_collection(
            ...     ec, CompressionPolicy(rank=64, min_rows_to_compress=0, min_params_to_compress=0, min_gain=0.0))
            >>> ttm.compressed_tables()
            ['t']
        """
        tables = ec.embedding_configs()
        weights = {name: emb.weight for name, emb in getattr(ec, "embeddings", {}).items()}
        missing = [t.name for t in tables if t.name not in weights]
        if missing:
            raise ValueError(f"from_embedding_collection: no weights found for tables {missing}")
        device = next(iter(weights.values())).device
        out = cls(
            tables,
            policy,
            device="meta",
            need_indices=ec.need_indices(),
            validate_inputs=validate_inputs,
            allow_extra_keys=allow_extra_keys,
        )
        if device.type != "meta":  # a meta model has no weights to decompose
            for g, members in enumerate(out._group_tables):
                old = out.groups[g]
                out.groups[g] = StackedTTMTables.from_embeddings(
                    [weights[n].detach() for n in members],
                    list(old.ranks),
                    row_shape=old.row_shape,
                    col_shape=old.col_shape,
                ).to(device)
        if out.dense is not None:
            out.dense = EmbeddingCollection(
                out.dense.embedding_configs(), device=device, need_indices=ec.need_indices()
            )
            if device.type != "meta":
                with torch.no_grad():
                    for name, emb in out.dense.embeddings.items():
                        emb.weight.copy_(weights[name])
            for name, emb in out.dense.embeddings.items():  # the sharder fuses the user's optimiser
                carry_in_backward_optimizers(weights[name], emb.weight)
        out._device = device
        return out
