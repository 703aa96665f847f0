"""Streaming Criteo readers: TSV (plain or gzip), Parquet, and TorchRec's npy layout.

All three are ``torch.utils.data.IterableDataset`` s that yield
``torchrec.datasets.utils.Batch`` (see :func:`comera_rec.data.criteo.make_batch`).

- Sharding: the rows of the chosen split are cut into ``world_size`` contiguous parts
  (sizes differ by at most one row); rank ``r`` reads part ``r``. Inside a DataLoader
  with ``num_workers > 1`` each rank's part is cut again per worker. Every row is read
  by exactly one (rank, worker).
- Memory: a TSV reader holds one byte chunk (``chunk_bytes``) plus one batch; Parquet
  and npy readers hold one row group / slice of ``chunk_rows`` rows plus one batch.
- Bad input (TSV): lines with the wrong number of fields, non-integer dense values,
  non-hex categories, labels other than 0/1, and empty files. ``bad_input="skip"``
  drops the line, counts it in ``reader.stats`` and logs it; ``"strict"`` raises
  :class:`BadInputError` naming the file and the 1-based line number. A missing path
  always raises ``FileNotFoundError`` when the reader is built: a typo must not silently
  train on less data.
"""

from __future__ import annotations

import gzip
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch

from comera_rec.data.criteo import (
    CAT_FEATURE_COUNT,
    CAT_NAMES,
    INT_FEATURE_COUNT,
    INT_NAMES,
    LABEL_NAME,
    NO_LABEL,
    TSV_COLUMNS_WITH_LABEL,
    TSV_COLUMNS_WITHOUT_LABEL,
    BatchBuffer,
    make_batch,
    shard_range,
    split_row_range,
)
from comera_rec.data.transforms import CategoricalTransform, dense_transform, parse_hex

logger = logging.getLogger(__name__)

# (labels float32 [n], dense float32 [n, 13], cat raw int64 [n, 26], cat missing bool [n, 26])
Chunk = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# (labels float32 [n], dense raw int64 [n, 13] (missing = 0), dense missing bool [n, 13],
#  cat raw int64 [n, 26] (missing = 0), cat missing bool [n, 26])
RawChunk = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_MAX_LOGGED_BAD_LINES = 10
_INT_PATTERN = r"^-?[0-9]{1,18}$"


class BadInputError(ValueError):
    """Malformed Criteo input under ``bad_input="strict"`` (message names file and line)."""


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
    """Skipped lines per reason ("fields", "int", "hex", "label")."""


def _open_binary(path: Path) -> io.BufferedIOBase:
    """Open plain or gzip (detected by magic bytes) for binary reading."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def count_lines(path: str | Path, block_bytes: int = 16 << 20) -> int:
    """Lines in a plain or gzip text file (a last line without newline counts).

    Example::

        n = count_lines("day_0.gz")
    """
    n, last = 0, b"\n"
    with _open_binary(Path(path)) as f:
        while block := f.read(block_bytes):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


class _CriteoReader(IterableDataset):
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

    # -- to implement -------------------------------------------------------------------
    def _all_paths(self) -> List[Path]:
        return self.paths

    def _count_file_rows(self) -> List[int]:
        raise NotImplementedError

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[Chunk]:
        """Chunks of rows [lo, hi) of file ``file_idx`` (hi=None: to the end)."""
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

    def __iter__(self) -> Iterator[Batch]:
        plan, max_batches = self._plan()
        buf = BatchBuffer(self.config.batch_size)
        emitted = 0
        for file_idx, lo, hi in plan:
            for labels, dense, cat_raw, cat_missing in self._read_range(file_idx, lo, hi):
                self.stats.rows += len(labels)
                ids = self.cat_transform(cat_raw, cat_missing)
                for d, s, l in buf.add(dense, ids, labels):
                    if max_batches is not None and emitted >= max_batches:
                        return
                    emitted += 1
                    yield make_batch(d, s, l)
        if self.config.drop_last:
            return
        for d, s, l in buf.flush():
            yield make_batch(d, s, l)


class CriteoTsvReader(_CriteoReader):
    """Criteo TSV reader: Kaggle train.txt / test.txt, Terabyte day_N; plain or gzip.

    Parsing is vectorised: byte chunks of whole lines are split with pyarrow's CSV
    parser (dense columns typed int64); field counts per line are checked with numpy
    and categories decoded from the Arrow string buffers with a lookup table. A chunk
    whose dense columns fail the typed parse is re-parsed as strings and validated
    column by column, so bad lines are found exactly without slowing good chunks.

    Args:
        config: reader options; ``paths`` are the TSV files, read in order.

    Example::

        reader = CriteoTsvReader(CriteoReaderConfig(paths=["train.txt"], batch_size=2048,
                                 split="train", holdout="kaggle", rank=0, world_size=2))
        for batch in reader:
            batch.dense_features  # [2048, 13] float32
    """

    def __init__(self, config: CriteoReaderConfig) -> None:
        super().__init__(config)
        self._has_label: Optional[bool] = config.has_label
        self._logged_bad = 0

    def _count_file_rows(self) -> List[int]:
        if self.config.rows_per_file is not None:
            if len(self.config.rows_per_file) != len(self.paths):
                raise ValueError(f"rows_per_file has {len(self.config.rows_per_file)} entries for {len(self.paths)} paths")
            return [int(n) for n in self.config.rows_per_file]
        return [count_lines(p) for p in self.paths]

    def has_label(self) -> bool:
        """Whether lines start with a label (detected from the first line if not given)."""
        if self._has_label is None:
            for p in self.paths:
                with _open_binary(p) as f:
                    first = f.readline()
                if first.strip(b"\r\n"):
                    n = first.rstrip(b"\r\n").count(b"\t") + 1
                    if n == TSV_COLUMNS_WITH_LABEL:
                        self._has_label = True
                    elif n == TSV_COLUMNS_WITHOUT_LABEL:
                        self._has_label = False
                    else:
                        raise BadInputError(
                            f"{p}:1: cannot tell the layout: {n} fields, expected "
                            f"{TSV_COLUMNS_WITH_LABEL} (with label) or {TSV_COLUMNS_WITHOUT_LABEL}; set has_label"
                        )
                    break
            else:
                self._has_label = True
        return self._has_label

    # -- line blocks --------------------------------------------------------------------
    def _line_blocks(self, path: Path, lo: int, hi: Optional[int]) -> Iterator[Tuple[int, bytes]]:
        """(index of first line, bytes of whole lines each ending in newline) for lines [lo, hi)."""
        size = self.config.chunk_bytes
        with _open_binary(path) as f:
            line, rest = 0, b""
            while line < lo:  # skip lines before this shard
                block = f.read(size)
                if not block:
                    return
                n = block.count(b"\n")
                if line + n < lo:
                    line += n
                    continue
                nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
                rest = block[nl[lo - line - 1] + 1 :]
                line = lo
            while hi is None or line < hi:
                block = f.read(size)
                data = rest + block
                if not block:  # end of file: a last line may lack its newline
                    if not data:
                        return
                    if not data.endswith(b"\n"):
                        data += b"\n"
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    rest = data
                    continue
                body, rest = data[:cut], data[cut:]
                n = body.count(b"\n")
                if hi is not None and line + n > hi:
                    nl = np.flatnonzero(np.frombuffer(body, np.uint8) == 10)
                    body = body[: nl[hi - line - 1] + 1]
                    n = hi - line
                yield line, body
                line += n
                if not block:
                    return

    # -- parsing ------------------------------------------------------------------------
    def _bad(self, path: Path, line_idx: int, reason: str, detail: str) -> None:
        msg = f"{path}:{line_idx + 1}: {detail}"
        if self.config.bad_input == "strict":
            raise BadInputError(msg)
        self.stats.bad_lines += 1
        self.stats.bad_by_reason[reason] = self.stats.bad_by_reason.get(reason, 0) + 1
        if self._logged_bad < _MAX_LOGGED_BAD_LINES:
            logger.warning("skipping bad line %s", msg)
            self._logged_bad += 1
            if self._logged_bad == _MAX_LOGGED_BAD_LINES:
                logger.warning("further bad lines are counted, not logged")

    def parse_block(self, path: Path, first_line: int, block: bytes) -> Optional[RawChunk]:
        """Parse whole lines (``block``, first line index ``first_line``) into raw columns.

        Bad lines are dropped and counted (or raise under strict); None if none is left.
        """
        has_label = self.has_label()
        ncols = TSV_COLUMNS_WITH_LABEL if has_label else TSV_COLUMNS_WITHOUT_LABEL
        names = ([LABEL_NAME] if has_label else []) + INT_NAMES + CAT_NAMES

        read = pacsv.ReadOptions(column_names=names, block_size=1 << 22)
        parse = pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False, ignore_empty_lines=False)
        typed = {n: pa.string() for n in names}
        typed.update({n: pa.int64() for n in ([LABEL_NAME] if has_label else []) + INT_NAMES})
        typed_opts = pacsv.ConvertOptions(column_types=typed, null_values=[""], strings_can_be_null=False)

        # 1. fast path: typed columnar parse; pyarrow reports rows with a wrong field count
        #    (an empty line is not reported, so look for one first)
        table: Optional[pa.Table] = None
        if not (block.startswith(b"\n") or b"\n\n" in block):
            invalid: List[int] = []
            fast = pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False,
                                      ignore_empty_lines=False, invalid_row_handler=lambda row: invalid.append(1) or "skip")
            try:
                table = pacsv.read_csv(io.BytesIO(block), read, fast, typed_opts)
            except pa.ArrowInvalid:
                table = None
            if invalid:
                table = None
        if table is not None:
            line_idx = first_line + np.arange(table.num_rows)  # physical 0-based line index per row
            int_cols = {n: table.column(n) for n in INT_NAMES}
            bad = np.zeros(len(line_idx), bool)
        else:
            # 2. careful path: exact field count per line (tabs between newlines), drop bad lines
            buf = np.frombuffer(block, np.uint8)
            nl = np.flatnonzero(buf == 10)  # [L]
            tabs = np.flatnonzero(buf == 9)
            fields = np.diff(np.searchsorted(tabs, nl), prepend=0) + 1  # [L]
            line_idx = first_line + np.arange(len(nl))
            wrong = fields != ncols
            if wrong.any():
                for i in np.flatnonzero(wrong):
                    self._bad(path, int(line_idx[i]), "fields", f"wrong number of fields: {int(fields[i])}, expected {ncols}")
                starts = np.concatenate([[0], nl[:-1] + 1])
                keep = np.flatnonzero(~wrong)
                block = b"".join(block[starts[i] : nl[i] + 1] for i in keep)
                line_idx = line_idx[keep]
                if not block:
                    return None
            bad = np.zeros(len(line_idx), bool)
            try:
                table = pacsv.read_csv(io.BytesIO(block), read, parse, typed_opts)
                int_cols = {n: table.column(n) for n in INT_NAMES}
            except pa.ArrowInvalid:
                # strings, then validate each dense column and the label
                table = pacsv.read_csv(io.BytesIO(block), read, parse, pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=False))
                int_cols = {}
                for n in INT_NAMES:
                    col = table.column(n)
                    ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, _INT_PATTERN)).to_numpy(zero_copy_only=False)
                    for i in np.flatnonzero(~ok & ~bad):
                        self._bad(path, int(line_idx[i]), "int", f"non-integer dense feature {n}={col[int(i)].as_py()!r}")
                    bad |= ~ok
                    clean = pc.if_else(pa.array(ok), col, "")
                    int_cols[n] = pc.cast(pc.if_else(pc.equal(clean, ""), None, clean), pa.int64())
                if has_label:
                    lab = table.column(LABEL_NAME)
                    ok = pc.match_substring_regex(lab, r"^[01]$").to_numpy(zero_copy_only=False)
                    table = table.set_column(0, LABEL_NAME, pc.cast(pc.if_else(pa.array(ok), lab, "0"), pa.int64()))
                    for i in np.flatnonzero(~ok & ~bad):
                        self._bad(path, int(line_idx[i]), "label", f"bad label {lab[int(i)].as_py()!r}, expected 0 or 1")
                    bad |= ~ok

        if has_label:
            lab = table.column(LABEL_NAME)
            labels = pc.fill_null(lab, -1).to_numpy()
            ok = (labels == 0) | (labels == 1)
            for i in np.flatnonzero(~ok & ~bad):
                self._bad(path, int(line_idx[i]), "label", f"bad label {lab[int(i)].as_py()!r}, expected 0 or 1")
            bad |= ~ok
            labels = labels.astype(np.float32)
        else:
            labels = np.full(len(line_idx), NO_LABEL, np.float32)

        # 3. dense: missing -> 0, then log(1 + max(x, 0))
        dense_raw = np.empty((len(line_idx), INT_FEATURE_COUNT), np.int64)
        dense_missing = np.empty((len(line_idx), INT_FEATURE_COUNT), bool)
        for j, n in enumerate(INT_NAMES):
            dense_missing[:, j] = int_cols[n].is_null().to_numpy(zero_copy_only=False)
            dense_raw[:, j] = pc.fill_null(int_cols[n], 0).to_numpy()

        # 4. categories: hex -> raw id
        cat_raw = np.empty((len(line_idx), CAT_FEATURE_COUNT), np.int64)
        cat_missing = np.empty((len(line_idx), CAT_FEATURE_COUNT), bool)
        for j, n in enumerate(CAT_NAMES):
            col = table.column(n)
            cat_raw[:, j], cat_missing[:, j], bad_j = parse_hex(col)
            for i in np.flatnonzero(bad_j & ~bad):
                self._bad(path, int(line_idx[i]), "hex", f"non-hex category {n}={col[int(i)].as_py()!r}")
            bad |= bad_j

        if bad.any():
            keep = ~bad
            labels, dense_raw, dense_missing = labels[keep], dense_raw[keep], dense_missing[keep]
            cat_raw, cat_missing = cat_raw[keep], cat_missing[keep]
        return labels, dense_raw, dense_missing, cat_raw, cat_missing

    def read_raw(self, file_idx: int, lo: int = 0, hi: Optional[int] = None) -> Iterator[Tuple[int, RawChunk]]:
        """(bytes consumed, raw chunk) for lines [lo, hi) of file ``file_idx`` (used by preprocessing)."""
        path = self.paths[file_idx]
        n_before = self.stats.bad_lines
        any_line = False
        for first_line, block in self._line_blocks(path, lo, hi):
            any_line = True
            chunk = self.parse_block(path, first_line, block)
            yield len(block), chunk if chunk is not None else None  # type: ignore[misc]
        if not any_line and lo == 0 and self._file_rows_cache is None:
            self._empty_file(path)
        if self.stats.bad_lines > n_before:
            logger.warning("%s: skipped %d bad lines", path, self.stats.bad_lines - n_before)

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[Chunk]:
        for _, chunk in self.read_raw(file_idx, lo, hi):
            if chunk is not None and len(chunk[0]):
                labels, dense_raw, _, cat_raw, cat_missing = chunk
                yield labels, dense_transform(dense_raw), cat_raw, cat_missing


class CriteoParquetReader(_CriteoReader):
    """Reader for the Parquet files written by ``data/preprocess_criteo.py``.

    Columns: ``label`` (int8, absent for unlabeled data), ``int_0 .. int_12`` (int64,
    null = missing, raw values), ``cat_0 .. cat_25`` (int64 raw 32-bit ids, null =
    missing). Transforms are applied at read time (pass ``vocab_dir`` for the
    contiguous ids of the preprocessing run, or table sizes for hashing).

    Args:
        config: reader options; ``paths`` are Parquet files, read in order.

    Example::

        reader = CriteoParquetReader(CriteoReaderConfig(paths=["out/train.parquet"],
                                     vocab_dir="out", split="val", holdout="kaggle"))
        batch = next(iter(reader))
    """

    def _count_file_rows(self) -> List[int]:
        return [pq.ParquetFile(p).metadata.num_rows for p in self.paths]

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[Chunk]:
        pf = pq.ParquetFile(self.paths[file_idx])
        meta = pf.metadata
        hi = meta.num_rows if hi is None else hi
        if meta.num_rows == 0 and self._file_rows_cache is None:
            self._empty_file(self.paths[file_idx])
        has_label = LABEL_NAME in pf.schema_arrow.names
        groups, base, first = [], 0, None
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if base < hi and base + n > lo:
                groups.append(g)
                first = base if first is None else first
            base += n
        if not groups:
            return
        pos = first  # row index of the next row the iterator returns
        for rb in pf.iter_batches(batch_size=self.config.chunk_rows, row_groups=groups):
            a, b = max(lo - pos, 0), min(hi - pos, rb.num_rows)
            pos += rb.num_rows
            if a >= b:
                if pos >= hi:
                    break
                continue
            rb = rb.slice(a, b - a)
            yield self._convert(rb, has_label)
            if pos >= hi:
                break

    @staticmethod
    def _convert(rb: pa.RecordBatch, has_label: bool) -> Chunk:
        n = rb.num_rows
        if has_label:
            labels = pc.fill_null(rb.column(LABEL_NAME), -1).to_numpy().astype(np.float32)
        else:
            labels = np.full(n, NO_LABEL, np.float32)
        dense_raw = np.empty((n, INT_FEATURE_COUNT), np.int64)
        for j, name in enumerate(INT_NAMES):
            dense_raw[:, j] = pc.fill_null(rb.column(name), 0).to_numpy()
        cat_raw = np.empty((n, CAT_FEATURE_COUNT), np.int64)
        cat_missing = np.empty((n, CAT_FEATURE_COUNT), bool)
        for j, name in enumerate(CAT_NAMES):
            col = rb.column(name)
            cat_missing[:, j] = col.is_null().to_numpy(zero_copy_only=False)
            cat_raw[:, j] = pc.fill_null(col, 0).to_numpy()
        return labels, dense_transform(dense_raw), cat_raw, cat_missing


class CriteoNpyReader(_CriteoReader):
    """Reader for TorchRec's preprocessed layout: ``X_dense.npy``, ``X_sparse.npy``, ``X_labels.npy``.

    ``paths`` name the ``*_dense.npy`` files; the sparse and label files are found beside
    them. Arrays are memory-mapped and read ``chunk_rows`` rows at a time. Dense values
    are taken as they are (TorchRec stored them log-transformed) unless
    ``dense_is_transformed=False``, in which case our dense transform is applied. Sparse
    ids cannot tell missing from raw id 0.

    Args:
        config: reader options.

    Example::

        reader = CriteoNpyReader(CriteoReaderConfig(paths=[f"day_{d}_dense.npy" for d in range(24)],
                                 split="test", holdout="last_file",
                                 num_embeddings_per_feature=TERABYTE_NUM_EMBEDDINGS))
    """

    def __init__(self, config: CriteoReaderConfig) -> None:
        for p in config.paths:
            if not str(p).endswith("_dense.npy"):
                raise ValueError(f"npy reader paths must be '*_dense.npy' files, got {p}")
        super().__init__(config)

    def _triplet(self, path: Path) -> Tuple[Path, Path, Path]:
        stem = str(path)[: -len("_dense.npy")]
        return path, Path(stem + "_sparse.npy"), Path(stem + "_labels.npy")

    def _all_paths(self) -> List[Path]:
        return [q for p in self.paths for q in self._triplet(p)]

    def _count_file_rows(self) -> List[int]:
        rows = []
        for p in self.paths:
            shapes = [np.load(q, mmap_mode="r").shape for q in self._triplet(p)]
            if len({s[0] for s in shapes}) != 1:
                raise BadInputError(f"{p}: dense / sparse / labels row counts differ: {shapes}")
            if shapes[0][1:] != (INT_FEATURE_COUNT,) or shapes[1][1:] != (CAT_FEATURE_COUNT,):
                raise BadInputError(f"{p}: expected dense [N, 13] and sparse [N, 26], got {shapes[0]} and {shapes[1]}")
            rows.append(shapes[0][0])
        return rows

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[Chunk]:
        dense_p, sparse_p, labels_p = self._triplet(self.paths[file_idx])
        dense = np.load(dense_p, mmap_mode="r")
        sparse = np.load(sparse_p, mmap_mode="r")
        labels = np.load(labels_p, mmap_mode="r")
        hi = len(dense) if hi is None else hi
        if len(dense) == 0 and self._file_rows_cache is None:
            self._empty_file(dense_p)
        for a in range(lo, hi, self.config.chunk_rows):
            b = min(a + self.config.chunk_rows, hi)
            d = np.asarray(dense[a:b])
            d = d.astype(np.float32) if self.config.dense_is_transformed else dense_transform(d.astype(np.int64))
            s = np.asarray(sparse[a:b]).astype(np.int64)
            yield np.asarray(labels[a:b]).reshape(-1).astype(np.float32), d, s, np.zeros(s.shape, bool)
