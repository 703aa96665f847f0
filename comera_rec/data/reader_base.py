"""What the Criteo readers share: :class:`CriteoReaderConfig`, :class:`ReaderStats`,
:class:`BadInputError` and the split / shard / batching base class (re-exported by
:mod:`comera_rec.data.readers`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch

from comera_rec.data.criteo import BatchBuffer, make_batch, shard_range, split_row_range
from comera_rec.data.position import Interval, PassCursor, ReadPosition
from comera_rec.data.transforms import CategoricalTransform

logger = logging.getLogger("comera_rec.data.readers")  # the readers' logger name before the split into modules

# (labels float32 [n], dense float32 [n, 13], cat raw int64 [n, 26], cat missing bool [n, 26])
Chunk = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# (labels float32 [n], dense raw int64 [n, 13] (missing = 0), dense missing bool [n, 13],
#  cat raw int64 [n, 26] (missing = 0), cat missing bool [n, 26])
RawChunk = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# (row number in its file per row int64 [n], chunk): a reader's position needs the rows' numbers
NumberedChunk = Tuple[np.ndarray, Chunk]

_FILE_SHIFT = 40  # a row's key while batched: file index << 40 | row in the file


class BadInputError(ValueError):
    """Malformed Criteo input under ``bad_input="strict"`` (message names file and line)."""

    __module__ = "comera_rec.data.readers"  # its public home (re-exported there): tracebacks and pickles name it


@dataclass
class CriteoReaderConfig:
    """Options shared by the TSV, Parquet and npy readers.

    Example::

        cfg = CriteoReaderConfig(paths=["train.txt.gz"], batch_size=4096, split="train",
                                 holdout="kaggle", num_embeddings_per_feature=KAGGLE_NUM_EMBEDDINGS)
    """

    paths: List[str] = field(default_factory=list)
    """Input files read as one concatenated row sequence (npy: the ``*_dense.npy`` files)."""
    batch_size: int = 2048
    """Rows per batch."""
    rank: int = 0
    """This process's rank; it reads part ``rank`` of the split."""
    world_size: int = 1
    """Number of ranks the split is cut into."""
    split: str = "all"
    """"train", "val", "test" or "all" (see criteo.split_row_range)."""
    holdout: str = "none"
    """"kaggle" (last seventh held out), "last_file" (Terabyte day_23) or "none"."""
    num_embeddings_per_feature: Optional[List[int]] = None
    """26 table sizes: ids are taken modulo these (hashing). None: ids passed through."""
    vocab_dir: Optional[str] = None
    """Folder with ``vocab/`` and ``table_sizes.json``: contiguous remap (wins over hashing)."""
    bad_input: str = "skip"
    """"skip" (drop, count, log) or "strict" (raise BadInputError with file and line)."""
    drop_last: bool = False
    """Yield only full batches, the same number on every rank (floor(smallest part / B))."""
    has_label: Optional[bool] = None
    """TSV: whether the first column is the label (False for Kaggle test.txt); None = detect."""
    rows_per_file: Optional[List[int]] = None
    """TSV: known line counts per file, to skip counting lines when sharding or splitting."""
    chunk_bytes: int = 8 << 20
    """TSV: bytes parsed per step (bounds memory)."""
    chunk_rows: int = 1 << 16
    """Parquet / npy: rows read per step (bounds memory)."""
    dense_is_transformed: bool = True
    """npy: dense arrays already hold TorchRec's log transform (its tsv_to_npys output)."""


@dataclass
class ReaderStats:
    """What a reader has seen (per process; DataLoader workers keep their own copy)."""

    rows: int = 0
    """Good rows yielded."""
    bad_lines: int = 0
    """Lines skipped under bad_input="skip"."""
    empty_files: int = 0
    """Files with no rows."""
    bad_by_reason: Dict[str, int] = field(default_factory=dict)
    """Skipped lines per reason ("fields", "int", "hex", "label", "utf8", "cr")."""
    damaged_files: int = 0
    """Files whose gzip stream broke off (truncated / corrupt); read up to the damage."""
    damaged_row_groups: int = 0
    """Parquet row groups that could not be decoded (corrupt pages), skipped."""


class CriteoReaderBase(IterableDataset):
    """Shared split / shard / transform / batching logic; subclasses read row ranges."""

    def __init__(self, config: CriteoReaderConfig) -> None:
        super().__init__()
        if not config.paths:
            raise ValueError("CriteoReaderConfig.paths is empty")
        if config.bad_input not in ("skip", "strict"):
            raise ValueError(f"bad_input must be 'skip' or 'strict', got {config.bad_input!r}")
        if not 0 <= config.rank < config.world_size:
            raise ValueError(f"rank must be in [0, world_size={config.world_size}), got {config.rank}")
        self.config = config
        self.paths = [Path(p) for p in config.paths]
        for p in self._all_paths():
            if not p.is_file():
                raise FileNotFoundError(f"Criteo input file not found: {p}")
        if config.vocab_dir is not None:
            self.cat_transform = CategoricalTransform.from_vocab_dir(config.vocab_dir)
        elif config.num_embeddings_per_feature is not None:
            self.cat_transform = CategoricalTransform.hashing(config.num_embeddings_per_feature)
        else:
            self.cat_transform = CategoricalTransform()
        self.stats = ReaderStats()
        self._file_rows_cache: Optional[List[int]] = None
        self._cursor: Optional[PassCursor] = None  # the current pass (for position())
        self._resume: Optional[ReadPosition] = None  # what the next pass reads instead of the plan

    # -- to implement -------------------------------------------------------------------
    def _all_paths(self) -> List[Path]:
        return self.paths

    def _count_file_rows(self) -> List[int]:
        raise NotImplementedError

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[NumberedChunk]:
        """Chunks of rows [lo, hi) of file ``file_idx`` (hi=None: to the end), each with its
        rows' numbers in the file."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    def file_rows(self) -> List[int]:
        """Rows (TSV: physical lines) per input file; computed once."""
        if self._file_rows_cache is None:
            rows = self._count_file_rows()
            for p, n in zip(self.paths, rows):
                if n == 0:
                    self._empty_file(p)
            self._file_rows_cache = rows
        return self._file_rows_cache

    def _empty_file(self, path: Path) -> None:
        if self.config.bad_input == "strict":
            raise BadInputError(f"{path}: empty file (no rows)")
        self.stats.empty_files += 1
        logger.warning("skipping empty file %s", path)

    def _shard(self) -> Tuple[int, int]:
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.config.rank * workers + wid, self.config.world_size * workers

    def _plan(self) -> Tuple[List[Tuple[int, int, Optional[int]]], Optional[int]]:
        """Per-file row ranges this shard reads, and the batch cap for drop_last."""
        cfg = self.config
        shard, num_shards = self._shard()
        if num_shards == 1 and cfg.split == "all" and not cfg.drop_last and self._file_rows_cache is None:
            return [(i, 0, None) for i in range(len(self.paths))], None  # no counting needed
        rows = self.file_rows()
        start, stop = split_row_range(sum(rows), rows, cfg.split, cfg.holdout)
        lo, hi = shard_range(start, stop, shard, num_shards)
        max_batches = (stop - start) // num_shards // cfg.batch_size if cfg.drop_last else None
        plan, base = [], 0
        for i, n in enumerate(rows):
            a, b = max(lo, base), min(hi, base + n)
            if a < b:
                plan.append((i, a - base, b - base))
            base += n
        return plan, max_batches

    # -- position -----------------------------------------------------------------------
    def _file_bases(self) -> np.ndarray:
        """Global number of each file's first row ([files + 1]; counts the rows once)."""
        return np.concatenate([[0], np.cumsum(self.file_rows())]).astype(np.int64)

    def _global_row(self, key: int) -> int:
        return int(self._file_bases()[key >> _FILE_SHIFT]) + (key & ((1 << _FILE_SHIFT) - 1))

    def _global_plan(self, plan: List[Tuple[int, int, Optional[int]]]) -> List[Interval]:
        bases, rows = self._file_bases(), self.file_rows()
        return [(int(bases[f] + lo), int(bases[f] + (rows[f] if hi is None else hi))) for f, lo, hi in plan]

    def _file_plan(self, intervals: List[Interval]) -> List[Tuple[int, int, Optional[int]]]:
        """Global row intervals as per-file ranges (file, lo, hi), in the same order."""
        bases = self._file_bases()
        out: List[Tuple[int, int, Optional[int]]] = []
        for lo, hi in intervals:
            if hi > bases[-1]:
                raise ValueError(
                    f"data position: rows [{lo}, {hi}) are past the end of the input ({int(bases[-1])} rows); "
                    f"the files changed since the checkpoint"
                )
            for f in range(len(self.paths)):
                a, b = max(lo, int(bases[f])), min(hi, int(bases[f + 1]))
                if a < b:
                    out.append((f, a - int(bases[f]), b - int(bases[f])))
        return out

    def position(self) -> Optional[ReadPosition]:
        """What this reader has left of its current pass after the last batch it yielded
        (before a pass: all of the next one). Asks for the files' row counts once.

        Example::

            reader = CriteoTsvReader(CriteoReaderConfig(paths=["day_0.tsv"], batch_size=4096))
            it = iter(reader); next(it)
            reader.position().remaining  # [(4096, rows of the file)]
        """
        if self._cursor is None:
            if self._resume is not None:
                return self._resume
            plan, max_batches = self._plan()
            return ReadPosition(self._global_plan(plan), max_batches)
        return self._cursor.position()

    def resume(self, position: ReadPosition) -> None:
        """Read only ``position``'s rows in the next pass (later passes read the whole plan).

        Args:
            position: e.g. :func:`comera_rec.data.position.resume_position` of a checkpoint's.
        """
        self._resume = position

    def __iter__(self) -> Iterator[Batch]:
        if self._resume is not None:
            if get_worker_info() is not None:
                raise RuntimeError("a resumed data position cannot be split over DataLoader workers (num_workers=0)")
            pos, self._resume = self._resume, None
            plan, max_batches = self._file_plan(pos.remaining), pos.batches_left
        else:
            plan, max_batches = self._plan()
        # rows are tracked by key (file, row in file); global numbers need the files' row
        # counts, asked for only when a position is (a one-process pass never counts otherwise)
        cursor = self._cursor = PassCursor(lambda: self._global_plan(plan), max_batches, to_row=self._global_row)
        buf = BatchBuffer(self.config.batch_size)
        for file_idx, lo, hi in plan:
            for rows, (labels, dense, cat_raw, cat_missing) in self._read_range(file_idx, lo, hi):
                self.stats.rows += len(labels)
                ids = self.cat_transform(cat_raw, cat_missing)
                keys = (np.int64(file_idx) << _FILE_SHIFT) + rows.astype(np.int64)
                for d, s, y, k in buf.add(dense, ids, labels, keys):
                    if max_batches is not None and cursor.emitted >= max_batches:
                        return
                    cursor.yielded(int(k[-1]))
                    yield make_batch(d, s, y)
        if self.config.drop_last:
            return
        for d, s, y, k in buf.flush():
            cursor.yielded(int(k[-1]))
            yield make_batch(d, s, y)
