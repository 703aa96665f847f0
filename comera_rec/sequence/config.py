"""Sequence-model configurations: the masked-item model, its data and the whole run.

Each section is a dataclass with a docstring per field, read from YAML with
``section.key=value`` overrides (:func:`comera_rec.config.load_config`).

Example::

    >>> from comera_rec.config import load_config
    >>> cfg = load_config(SeqRunConfig, None, ["model.compressed=false", "data.num_items=300"])
    >>> cfg.model.compressed, cfg.data.num_items
    (False, 300)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from comera_rec.integration.policy import CompressionPolicy, TableRule
from comera_rec.rank import RankScheduleConfig
from comera_rec.training import OptimConfig, TrainerConfig

ITEM_TABLE = "item"
"""Name of the item table (``per_table`` overrides use it)."""
ITEM_FEATURE = "items"
"""The KJT key of the item sequences."""


@dataclass
class SeqModelConfig:
    """A BERT4Rec-style masked-item model, with a TT or a dense item table.

    Example::

        >>> cfg = SeqModelConfig(embedding_dim=32, num_heads=2)
        >>> cfg.policy().rank
        16
    """

    compressed: bool = True
    """Item table as a TTM tensor train (TTMEmbeddingCollection); False: TorchRec's dense EmbeddingCollection."""
    embedding_dim: int = 64
    """Item embedding and transformer width."""
    num_layers: int = 2
    """Transformer encoder layers."""
    num_heads: int = 2
    """Attention heads; must divide embedding_dim."""
    d_ff: int = 256
    """Inner size of each encoder layer's feed-forward block."""
    dropout: float = 0.1
    """Dropout on embeddings, attention and feed-forward outputs."""
    pre_norm: bool = False
    """LayerNorm before each encoder block's attention and feed-forward (pre-LN, with a final
    LayerNorm) instead of after them (post-LN, BERT's order)."""
    max_len: int = 50
    """Longest input sequence (the most recent items are kept); rows of the position embedding."""
    rank: int = 16
    """TT rank of the compressed item table."""
    min_rows_to_compress: int = 0
    """The policy's row threshold: a smaller item table stays dense even with compressed=true."""
    min_params_to_compress: int = 0
    """The policy's parameter threshold (rows x dim) below which the table stays dense."""
    min_gain: float = 1.0
    """Compress only if dense / TT parameters >= this."""
    per_table: dict[str, TableRule] = field(default_factory=dict)
    """Policy overrides by table name (the item table is "item"): a rank, "dense", "compress" or a TableOverride."""
    validate_inputs: bool = True
    """Check every item id against the table (an error names the feature and the value)."""

    def __post_init__(self) -> None:
        for name in ("embedding_dim", "num_layers", "num_heads", "d_ff", "max_len", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SeqModelConfig.{name} must be a positive integer, got {value!r}")
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"SeqModelConfig: num_heads={self.num_heads} must divide embedding_dim={self.embedding_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"SeqModelConfig.dropout must be in [0, 1), got {self.dropout!r}")

    def policy(self) -> CompressionPolicy:
        """The compression policy of the item table (MLPs and attention stay dense)."""
        return CompressionPolicy(
            rank=self.rank,
            min_rows_to_compress=self.min_rows_to_compress,
            min_params_to_compress=self.min_params_to_compress,
            min_gain=self.min_gain,
            per_table=dict(self.per_table),
            compress_mlps=False,
            compress_crossnet=False,
        )


@dataclass
class SeqDataConfig:
    """Where the item sequences come from, how they are split, masked and batched."""

    source: str = "synthetic"
    """"synthetic" (Markov sessions with a known best hit rate) or an interaction file (.csv, .tsv, .dat, .parquet)."""
    format: Literal["auto", "csv", "tsv", "dat", "parquet"] = "auto"
    """File format; "auto" goes by the suffix ("dat": MovieLens-1M's "::"-separated ratings.dat)."""
    separator: Optional[str] = None
    """Field separator of a text file (None: by format: "," csv, tab tsv, "::" dat)."""
    header: bool = True
    """The text file's first line names the columns; False: they are named by `columns`."""
    columns: Optional[list[str]] = None
    """Column names of a text file without a header, e.g. [user, item, rating, timestamp] for ml-100k u.data."""
    user_column: str = "userId"
    """Column of the user id."""
    item_column: str = "movieId"
    """Column of the item id."""
    time_column: str = "timestamp"
    """Column of the interaction time (numbers, or dates in Parquet); a user's items are sorted by it."""
    min_sequence_length: int = 3
    """Users with fewer interactions are dropped (leave-one-out needs 3: train, validation and test items)."""
    max_users: Optional[int] = None
    """Keep at most this many users (the first by id; None: all)."""
    num_users: int = 6000
    """Synthetic: sessions (users)."""
    num_items: int = 1000
    """Synthetic: items of the Markov chain."""
    min_length: int = 10
    """Synthetic: shortest session."""
    max_length: int = 30
    """Synthetic: longest session."""
    branching: int = 4
    """Synthetic: successors of each item (their probabilities fall as 1, 1/2, 1/3, ...)."""
    noise: float = 0.1
    """Synthetic: probability that the next item is uniform over all items instead of a successor."""
    clusters: int = 0
    """Synthetic: 0 draws every item's successors on its own; N > 0 puts the items in N hidden
    groups sharing their successors (a low-rank next-item matrix, like a catalogue's categories)."""
    generator_seed: int = 0
    """Synthetic: seed of the chain and the sessions."""
    batch_size: int = 128
    """Training sequences per process and step."""
    eval_batch_size: int = 512
    """Validation / test users per batch."""
    mask_prob: float = 0.2
    """Training: chance of each item to be masked and predicted (cloze task)."""
    mask_last_prob: float = 0.5
    """Training: chance that the last item is masked as well (the position predicted at evaluation)."""
    top_k: list[int] = field(default_factory=lambda: [1, 5, 10])
    """Cut-offs of the reported hit rate and NDCG."""

    def __post_init__(self) -> None:
        for name in ("min_sequence_length", "num_users", "num_items", "min_length", "max_length", "branching"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SeqDataConfig.{name} must be a positive integer, got {value!r}")
        for name in ("batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SeqDataConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.min_sequence_length < 3:
            raise ValueError(
                f"SeqDataConfig.min_sequence_length must be >= 3 (leave-one-out takes a validation and a "
                f"test item and leaves one to train on), got {self.min_sequence_length}"
            )
        if self.min_length < 3 or self.max_length < self.min_length:
            raise ValueError(
                f"SeqDataConfig: need 3 <= min_length <= max_length, got {self.min_length} and {self.max_length}"
            )
        if (
            isinstance(self.clusters, bool)
            or not isinstance(self.clusters, int)
            or not 0 <= self.clusters <= self.num_items
        ):
            raise ValueError(
                f"SeqDataConfig.clusters must be in [0, num_items={self.num_items}], got {self.clusters!r}"
            )
        if self.branching > self.num_items:
            raise ValueError(f"SeqDataConfig.branching={self.branching} exceeds num_items={self.num_items}")
        for name in ("noise", "mask_prob", "mask_last_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SeqDataConfig.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not self.top_k or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.top_k):
            raise ValueError(f"SeqDataConfig.top_k must list positive integers, got {self.top_k!r}")


@dataclass
class SeqRunConfig:
    """A whole masked-item training run, as read from ``configs/seq_*.yaml`` plus overrides."""

    model: SeqModelConfig = field(default_factory=SeqModelConfig)
    """The model (item table kind, encoder sizes, compression policy)."""
    data: SeqDataConfig = field(default_factory=SeqDataConfig)
    """The sequences (synthetic or a file), masking and batches."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The engine's loop settings."""
    schedule: RankScheduleConfig = field(default_factory=lambda: RankScheduleConfig(enabled=False))
    """The rank-adaptive objective of the TT item table (off by default; always off for the dense model)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr_cores=1e-3, lr_controllers=1e-3, lr_other=1e-3))
    """The engine's optimiser (TT cores, controllers, and the rest: dense table, encoder, head)."""
