"""Criteo data: streaming readers (TSV, Parquet, npy), transforms, synthetic generator.

The trainer calls :func:`build_dataloaders` with a :class:`DataConfig` and gets two
iterables of ``torchrec.datasets.utils.Batch`` (dense [B, 13] float32,
KeyedJaggedTensor of ``cat_0 .. cat_25`` with one id each, labels [B] float32).

Example::

    cfg = DataConfig(source="synthetic", batch_size=2048, rank=rank, world_size=world_size,
                     num_embeddings_per_feature=[100_000] * 26)
    train, val = build_dataloaders(cfg)
    for epoch in range(2):
        set_epoch(train, epoch)
        for batch in train:
            ...
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Tuple

from torch.utils.data import DataLoader, IterableDataset
from torchrec.datasets.utils import Batch

from comera_rec.config import ConfigError
from comera_rec.data.criteo import (
    CAT_FEATURE_COUNT,
    CAT_NAMES,
    INT_FEATURE_COUNT,
    INT_NAMES,
    KAGGLE_NUM_EMBEDDINGS,
    KAGGLE_TRAIN_ROWS,
    TERABYTE_NUM_EMBEDDINGS,
    make_batch,
    shard_range,
    split_row_range,
)

# The readers, the transforms and the synthetic generator import pyarrow: about 48 MB of a
# process's RSS. They are imported on first use (PEP 562), so that a process which only
# builds or scores a model (the DLRM config reads the Criteo constants above) leaves them out.
_LAZY = {
    **dict.fromkeys(
        (
            "BadInputError",
            "CriteoNpyReader",
            "CriteoParquetReader",
            "CriteoReaderConfig",
            "CriteoTsvReader",
            "ReaderStats",
            "count_lines",
        ),
        "comera_rec.data.readers",
    ),
    **dict.fromkeys(
        ("SyntheticCriteo", "SyntheticCriteoConfig", "ZipfSampler", "expected_auc", "roc_auc"),
        "comera_rec.data.synthetic",
    ),
    **dict.fromkeys(
        ("CategoricalTransform", "dense_transform", "load_table_sizes", "parse_hex"), "comera_rec.data.transforms"
    ),
}

if TYPE_CHECKING:
    from comera_rec.data.readers import (
        BadInputError,
        CriteoNpyReader,
        CriteoParquetReader,
        CriteoReaderConfig,
        CriteoTsvReader,
        ReaderStats,
        count_lines,
    )
    from comera_rec.data.synthetic import SyntheticCriteo, SyntheticCriteoConfig, ZipfSampler, expected_auc, roc_auc
    from comera_rec.data.transforms import CategoricalTransform, dense_transform, load_table_sizes, parse_hex


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found directly from now on
    return value


SOURCES = ("synthetic", "tsv", "parquet", "npy")


@dataclass
class DataConfig:
    """What the trainer asks of the data layer.

    Example::

        DataConfig(source="parquet", train_paths=["criteo_pq/train.parquet"], holdout="kaggle",
                   vocab_dir="criteo_pq", batch_size=4096, rank=0, world_size=2)
    """

    source: str = "synthetic"
    """"synthetic", "tsv", "parquet" or "npy"."""
    train_paths: List[str] = field(default_factory=list)
    """Files read in order (npy: the ``*_dense.npy`` files). Unused for synthetic."""
    val_paths: List[str] = field(default_factory=list)
    """Separate validation files; empty = the ``val_split`` hold-out of train_paths."""
    holdout: str = "kaggle"
    """Hold-out scheme over train_paths: "kaggle", "last_file" (Terabyte) or "none"."""
    val_split: str = "val"
    """Which half of the hold-out to evaluate on: "val" or "test"."""
    batch_size: int = 2048
    """Training rows per batch (per rank)."""
    val_batch_size: Optional[int] = None
    """Validation rows per batch; None = batch_size."""
    rank: int = 0
    """This process's rank."""
    world_size: int = 1
    """Number of ranks; each reads a disjoint part."""
    num_embeddings_per_feature: Optional[List[int]] = None
    """26 table sizes: synthetic cardinalities / hashing modulus. None: Kaggle sizes for synthetic, no hashing for files."""
    vocab_dir: Optional[str] = None
    """Preprocessing output folder: contiguous ids via its vocabularies (files only)."""
    seed: int = 0
    """Synthetic: seed of the hidden model and the rows."""
    zipf_exponent: float = 1.1
    """Synthetic: Zipf exponent of id popularity."""
    synthetic_train_rows: Optional[int] = 1 << 20
    """Synthetic: training rows per epoch over all ranks (fresh rows each epoch); None = endless."""
    synthetic_val_rows: int = 1 << 16
    """Synthetic: rows of the fixed validation set over all ranks."""
    bad_input: str = "skip"
    """"skip" or "strict" (see readers)."""
    drop_last: bool = True
    """Training: only full batches, the same count on every rank (validation keeps all rows)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = read in the training process)."""

    def __post_init__(self) -> None:
        """Refuse batch sizes that cannot give a batch (0 divided the row counts later).

        Raises:
            ConfigError: (a ValueError) ``batch_size`` below 1, or ``val_batch_size`` neither None nor >= 1;
                the message names the field as written in a run config (``data.batch_size``).
        """
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(
                f"data.batch_size must be an integer >= 1 (training rows per batch and process), "
                f"got {self.batch_size!r}"
            )
        vbs = self.val_batch_size
        if vbs is not None and (isinstance(vbs, bool) or not isinstance(vbs, int) or vbs < 1):
            raise ConfigError(
                f"data.val_batch_size must be an integer >= 1, or null to use data.batch_size, got {vbs!r}"
            )


def _identity(x: Any) -> Any:
    return x


def num_embeddings(cfg: DataConfig) -> List[int]:
    """Table sizes the model should use with this data config.

    Example::

        >>> num_embeddings(DataConfig())[:3]
        [1460, 583, 10131227]
    """
    if cfg.vocab_dir is not None and cfg.source != "synthetic":
        from comera_rec.data.transforms import load_table_sizes

        return load_table_sizes(cfg.vocab_dir)
    if cfg.num_embeddings_per_feature is not None:
        return list(cfg.num_embeddings_per_feature)
    if cfg.source == "synthetic":
        return list(KAGGLE_NUM_EMBEDDINGS)
    raise ValueError("files read without vocab_dir need num_embeddings_per_feature (hashing sizes)")


def set_epoch(loader: Iterable[Batch], epoch: int) -> None:
    """Tell a loader from build_dataloaders which epoch it serves (fresh synthetic rows)."""
    ds = loader.dataset if isinstance(loader, DataLoader) else loader
    if hasattr(ds, "set_epoch"):
        ds.set_epoch(epoch)


def _wrap(ds: IterableDataset, num_workers: int) -> Iterable[Batch]:
    if num_workers == 0:
        return ds
    return DataLoader(ds, batch_size=None, num_workers=num_workers, collate_fn=_identity, persistent_workers=False)


def build_dataloaders(cfg: DataConfig) -> Tuple[Iterable[Batch], Optional[Iterable[Batch]]]:
    """Build the training and validation iterables of ``Batch`` for this rank.

    Args:
        cfg: data options (see :class:`DataConfig`).

    Returns:
        (train, val): IterableDatasets (or DataLoaders when ``num_workers > 0``); val is
        None when there is nothing to validate on (files with ``holdout="none"`` and no
        ``val_paths``).

    Example::

        train, val = build_dataloaders(DataConfig(source="synthetic", synthetic_train_rows=8192))
        batch = next(iter(train))  # batch.dense_features: [2048, 13]
    """
    if cfg.source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {cfg.source!r}")
    val_bs = cfg.val_batch_size or cfg.batch_size
    if cfg.source == "synthetic":
        from comera_rec.data.synthetic import SyntheticCriteo, SyntheticCriteoConfig

        base = SyntheticCriteoConfig(
            num_embeddings_per_feature=num_embeddings(cfg),
            zipf_exponent=cfg.zipf_exponent,
            seed=cfg.seed,
            rank=cfg.rank,
            world_size=cfg.world_size,
        )
        train = SyntheticCriteo(
            SyntheticCriteoConfig(
                **{
                    **base.__dict__,
                    "batch_size": cfg.batch_size,
                    "num_rows": cfg.synthetic_train_rows,
                    "drop_last": cfg.drop_last,
                }
            )
        )
        val = SyntheticCriteo(
            SyntheticCriteoConfig(
                **{**base.__dict__, "batch_size": val_bs, "num_rows": cfg.synthetic_val_rows, "stream": "val"}
            )
        )
        return _wrap(train, cfg.num_workers), _wrap(val, cfg.num_workers)

    if not cfg.train_paths:
        raise ValueError(f"source {cfg.source!r} needs train_paths")
    from comera_rec.data.readers import CriteoNpyReader, CriteoParquetReader, CriteoReaderConfig, CriteoTsvReader

    reader_cls = {"tsv": CriteoTsvReader, "parquet": CriteoParquetReader, "npy": CriteoNpyReader}[cfg.source]
    common = dict(
        rank=cfg.rank,
        world_size=cfg.world_size,
        num_embeddings_per_feature=cfg.num_embeddings_per_feature,
        vocab_dir=cfg.vocab_dir,
        bad_input=cfg.bad_input,
    )
    train = reader_cls(
        CriteoReaderConfig(
            paths=list(cfg.train_paths),
            batch_size=cfg.batch_size,
            split="train" if cfg.holdout != "none" else "all",
            holdout=cfg.holdout,
            drop_last=cfg.drop_last,
            **common,
        )
    )
    if cfg.val_paths:
        val = reader_cls(
            CriteoReaderConfig(paths=list(cfg.val_paths), batch_size=val_bs, split="all", holdout="none", **common)
        )
    elif cfg.holdout != "none":
        val = reader_cls(
            CriteoReaderConfig(
                paths=list(cfg.train_paths), batch_size=val_bs, split=cfg.val_split, holdout=cfg.holdout, **common
            )
        )
    else:
        val = None
    return _wrap(train, cfg.num_workers), (_wrap(val, cfg.num_workers) if val is not None else None)


__all__ = [
    "BadInputError",
    "CAT_FEATURE_COUNT",
    "CAT_NAMES",
    "CategoricalTransform",
    "CriteoNpyReader",
    "CriteoParquetReader",
    "CriteoReaderConfig",
    "CriteoTsvReader",
    "DataConfig",
    "INT_FEATURE_COUNT",
    "INT_NAMES",
    "KAGGLE_NUM_EMBEDDINGS",
    "KAGGLE_TRAIN_ROWS",
    "ReaderStats",
    "SyntheticCriteo",
    "SyntheticCriteoConfig",
    "TERABYTE_NUM_EMBEDDINGS",
    "ZipfSampler",
    "build_dataloaders",
    "count_lines",
    "dense_transform",
    "expected_auc",
    "load_table_sizes",
    "make_batch",
    "num_embeddings",
    "parse_hex",
    "roc_auc",
    "set_epoch",
    "shard_range",
    "split_row_range",
]
