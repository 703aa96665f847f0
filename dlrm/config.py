"""DLRM configurations: a dataclass of flat fields, with the Criteo reference presets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from comera_rec.data.criteo import KAGGLE_NUM_EMBEDDINGS, TERABYTE_NUM_EMBEDDINGS
from comera_rec.integration.policy import CompressionPolicy, TableRule

# Criteo Kaggle (DLRM reference script): 26 tables, 33.8M rows; MLPerf DLRM-DCNv2 (Criteo
# 1TB multi-hot): 26 tables, 204M rows. The data readers' lists, as tuples.
KAGGLE_TABLE_SIZES: tuple[int, ...] = tuple(KAGGLE_NUM_EMBEDDINGS)
MLPERF_TABLE_SIZES: tuple[int, ...] = tuple(TERABYTE_NUM_EMBEDDINGS)


@dataclass
class DLRMConfig:
    """A DLRM or DLRM-DCN model, dense or compressed. Defaults: Criteo Kaggle reference.

    Example::

        >>> cfg = DLRMConfig(table_sizes=[1000, 50], embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
        >>> cfg.num_tables, cfg.policy().rank
        (2, 32)
    """

    table_sizes: list[int] = field(default_factory=lambda: list(KAGGLE_TABLE_SIZES))
    """Rows of each embedding table (one sparse feature per table)."""
    embedding_dim: int = 16
    """Embedding dimension of every table (DLRM needs one value)."""
    dense_in_features: int = 13
    """Number of dense (integer) input features."""
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    """Bottom (dense arch) layer sizes; the last must equal ``embedding_dim``."""
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    """Top (over arch) layer sizes; the last is the number of logits (1)."""
    interaction: Literal["dot", "dcn"] = "dot"
    """``"dot"``: TorchRec ``DLRM`` (pairwise dot products); ``"dcn"``: ``DLRM_DCN``."""
    fused_interaction: bool = False
    """Use :class:`comera_rec.dlrm.interaction.PairwiseDotInteraction` for the ``"dot"`` interaction:
    TorchRec's values, a backward without ``index_put`` accumulation, on CPU one fused kernel
    (docs/performance.md); and :class:`comera_rec.dlrm.interaction.FlatSparseArch` for the sparse arch
    (no per-feature split and concatenation; a plain fused collection's tables through the
    fused CPU row-wise Adagrad kernel). ``False`` keeps TorchRec's ``InteractionArch`` and
    ``SparseArch``."""
    dcn_num_layers: int = 3
    """Cross layers of the DCN interaction."""
    dcn_low_rank: int = 512
    """Inner size of each DCN cross layer."""
    compressed: bool = True
    """Build TTM tables and TT layers (``False``: TorchRec's dense model)."""
    rank: int = 32
    """TT rank of compressed tables."""
    mlp_rank: int | None = None
    """TT rank of MLP and cross-net layers (``rank`` when ``None``)."""
    min_rows_to_compress: int = 10_000
    """Tables with fewer rows stay dense (FBGEMM kernels, sharded by TorchRec)."""
    min_params_to_compress: int = 1_000_000
    """Tables with fewer dense parameters (rows x dim) stay dense too."""
    min_gain: float = 2.0
    """Compress a table or layer only if dense / TT parameters >= this."""
    mlp_min_gain: float | None = None
    """The same for MLP and cross-net layers (``min_gain`` when ``None``); a TT layer must also
    need no more multiply-adds than the dense one."""
    share_shapes_within: float = 2.0
    """A table takes a larger one's TT shape, to be looked up with it in one call, when that
    costs at most this many times its own TT parameters (0: off)."""
    two_cores_within: float = 2.0
    """Give a table 2 cores when they take at most this many times the parameters of its default 3 or 4 (0: off)."""
    per_table: dict[str, TableRule] = field(default_factory=dict)
    """Per-table overrides by table name (``"t_cat_3"``): ``"dense"``, ``"compress"``, a rank or a TableOverride."""
    feature_names: list[str] | None = None
    """Sparse feature names (``cat_0`` ... by default, as TorchRec's Criteo loaders)."""
    pooling: Literal["sum", "mean"] = "sum"
    """Pooling of every table."""
    validate_inputs: bool = True
    """Check every sparse id against its table (errors name the feature and value)."""

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    def features(self) -> list[str]:
        names = self.feature_names or [f"cat_{i}" for i in range(self.num_tables)]
        if len(names) != self.num_tables:
            raise ValueError(f"DLRMConfig: {len(names)} feature_names for {self.num_tables} tables")
        return list(names)

    def policy(self) -> CompressionPolicy:
        """The compression policy these fields describe."""
        return CompressionPolicy(
            rank=self.rank,
            min_rows_to_compress=self.min_rows_to_compress,
            min_params_to_compress=self.min_params_to_compress,
            min_gain=self.min_gain,
            per_table=dict(self.per_table),
            linear_rank=self.mlp_rank,
            linear_min_gain=self.mlp_min_gain,
            share_shapes_within=self.share_shapes_within,
            two_cores_within=self.two_cores_within,
        )

    @classmethod
    def kaggle(cls, **overrides: object) -> "DLRMConfig":
        """Criteo Kaggle reference (method section 5), its 256 -> 64 bottom layer a TT layer too
        (``mlp_min_gain=1.5``: at rank 32 that layer is 1.54x smaller and 1.6x cheaper than
        dense, and the Kaggle step 1.02-1.05x faster; docs/performance-history.md)."""
        base: dict[str, object] = {"mlp_min_gain": 1.5}
        return cls(**{**base, **overrides})  # type: ignore[arg-type]

    @classmethod
    def mlperf_dcn(cls, **overrides: object) -> "DLRMConfig":
        """MLPerf DLRM-DCNv2 reference shapes (Criteo 1TB multi-hot)."""
        base: Mapping[str, object] = dict(
            table_sizes=list(MLPERF_TABLE_SIZES),
            embedding_dim=128,
            bottom_mlp=[512, 256, 128],
            top_mlp=[1024, 1024, 512, 256, 1],
            interaction="dcn",
            dcn_num_layers=3,
            dcn_low_rank=512,
        )
        return cls(**{**base, **overrides})  # type: ignore[arg-type]
