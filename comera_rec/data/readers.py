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
  non-hex categories, labels other than 0/1, invalid UTF-8 bytes, a carriage return
  inside a line, and empty files. ``bad_input="skip"`` drops the line, counts it in
  ``reader.stats`` and logs it; ``"strict"`` raises :class:`BadInputError` naming the
  file and the 1-based line number. A gzip stream that breaks off (truncated or
  corrupt) keeps the whole lines before the damage, then raises (strict) or stops that
  file with a warning and counts it (skip). A missing path always raises
  ``FileNotFoundError`` when the reader is built: a typo must not silently train on less
  data. Files of the wrong format (Parquet columns of the wrong type, npy arrays of the
  wrong shape or holding Python objects, npy triplets whose row counts differ) raise
  :class:`BadInputError` naming the file in both modes: skipping them would silently
  train on less data too.
"""

from __future__ import annotations

import gzip
import io
import logging
import zlib
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
# what a damaged gzip stream raises on read: truncated (EOFError), corrupt deflate data
# (zlib.error), a bad header or CRC (gzip.BadGzipFile)
_STREAM_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


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
    """Skipped lines per reason ("fields", "int", "hex", "label", "utf8", "cr")."""
    damaged_files: int = 0
    """Files whose gzip stream broke off (truncated / corrupt); read up to the damage."""
    damaged_row_groups: int = 0
    """Parquet row groups that could not be decoded (corrupt pages), skipped."""


def _open_binary(path: Path) -> io.BufferedIOBase:
    """Open plain or gzip (detected by magic bytes) for binary reading."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _read_block(f: io.BufferedIOBase, size: int) -> Tuple[bytes, Optional[Exception]]:
    """Up to ``size`` bytes, and the error of a damaged gzip stream if reading stopped on one.

    Reads with ``read1`` so that the bytes decompressed before the damage are returned,
    not lost with the exception (``read(size)`` drops what it had gathered).
    """
    parts: List[bytes] = []
    n = 0
    while n < size:
        try:
            part = f.read1(size - n)
        except _STREAM_ERRORS as e:
            return b"".join(parts), e
        if not part:
            break
        parts.append(part)
        n += len(part)
    return b"".join(parts), None


def _compressed_pos(f: io.BufferedIOBase, path: Path) -> str:
    """ "near byte X of Y (compressed)" for a gzip file, for messages about its damage."""
    try:
        return f" near compressed byte {f.fileobj.tell()} of {path.stat().st_size}"  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return ""


def _damage_message(path: Path, lines: int, pos: str, err: Exception) -> str:
    return (
        f"{path}: damaged gzip stream after line {lines}{pos}: {type(err).__name__}: {err} "
        f"(truncated or corrupt file; the {lines} whole lines before the damage are readable)"
    )


def _count_lines(path: Path, block_bytes: int) -> Tuple[int, Optional[str]]:
    """(lines, message of a damaged gzip stream or None); with damage, whole lines before it."""
    n, last = 0, b"\n"
    with _open_binary(path) as f:
        while True:
            block, err = _read_block(f, block_bytes)
            n += block.count(b"\n")
            if block:
                last = block[-1:]
            if err is not None:
                return n, _damage_message(path, n, _compressed_pos(f, path), err)
            if not block:
                break
    return n + (last != b"\n"), None


def count_lines(path: str | Path, block_bytes: int = 16 << 20) -> int:
    """Lines in a plain or gzip text file (a last line without newline counts).

    Raises :class:`BadInputError` naming the file if its gzip stream is damaged.

    Example::

        n = count_lines("day_0.gz")
    """
    n, damage = _count_lines(Path(path), block_bytes)
    if damage is not None:
        raise BadInputError(damage)
    return n


def _load_npy(path: Path) -> np.ndarray:
    """Memory-map a numeric .npy array; never unpickles (a file of Python objects is an error)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise BadInputError(
            f"{path}: not a numeric .npy array ({e}); files holding pickled Python objects "
            "are never loaded (allow_pickle=False)"
        ) from e
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise BadInputError(f"{path}: dtype {getattr(arr, 'dtype', type(arr).__name__)}, expected a numeric array")
    return arr


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
                for d, s, y in buf.add(dense, ids, labels):
                    if max_batches is not None and emitted >= max_batches:
                        return
                    emitted += 1
                    yield make_batch(d, s, y)
        if self.config.drop_last:
            return
        for d, s, y in buf.flush():
            yield make_batch(d, s, y)


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
        self._damaged: set = set()  # paths whose damage was already reported (counting, then reading)

    def _count_file_rows(self) -> List[int]:
        if self.config.rows_per_file is not None:
            if len(self.config.rows_per_file) != len(self.paths):
                raise ValueError(
                    f"rows_per_file has {len(self.config.rows_per_file)} entries for {len(self.paths)} paths"
                )
            return [int(n) for n in self.config.rows_per_file]
        rows = []
        for p in self.paths:
            n, damage = _count_lines(p, 16 << 20)
            if damage is not None:
                self._damaged_file(p, damage)  # skip: the file counts its whole lines before the damage
            rows.append(n)
        return rows

    def _damaged_file(self, path: Path, msg: str) -> None:
        """A gzip stream that broke off: raise (strict), or count and warn once per file (skip)."""
        if path in self._damaged:
            return
        self._damaged.add(path)
        if self.config.bad_input == "strict":
            raise BadInputError(msg)
        self.stats.damaged_files += 1
        logger.warning("stopping this file at the damage (bad_input=skip): %s", msg)

    def has_label(self) -> bool:
        """Whether lines start with a label (detected from the first line if not given)."""
        if self._has_label is None:
            for p in self.paths:
                with _open_binary(p) as f:
                    first, _ = _read_block(f, 1 << 16)  # a damaged stream is reported when read
                    first = first.split(b"\n", 1)[0]
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
            line, rest, err = 0, b"", None
            while line < lo:  # skip lines before this shard
                block, err = _read_block(f, size)
                n = block.count(b"\n")
                if line + n < lo:
                    line += n
                    if not block or err is not None:
                        break
                    continue
                nl = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
                rest = block[nl[lo - line - 1] + 1 :]
                line = lo
            while line >= lo and (hi is None or line < hi):
                block = b""
                if err is None:
                    block, err = _read_block(f, size)
                data = rest + block
                end = err is not None or not block
                if err is not None:  # damaged stream: only whole lines before the damage count
                    data = data[: data.rfind(b"\n") + 1]
                elif not block and data and not data.endswith(b"\n"):
                    data += b"\n"  # end of file: a last line may lack its newline
                if not data and end:
                    break
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
                if end:
                    break
            if err is not None and (hi is None or line < hi):
                self._damaged_file(path, _damage_message(path, line, _compressed_pos(f, path), err))

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

    def _broken_lines(
        self,
        path: Path,
        block: bytes,
        buf: np.ndarray,
        nl: np.ndarray,
        starts: np.ndarray,
        tabs: np.ndarray,
        line_idx: np.ndarray,
        names: List[str],
    ) -> np.ndarray:
        """Lines with an invalid UTF-8 byte or a carriage return inside them, reported; bool [L].

        pyarrow cannot convert the first (no file or line in its error) and splits a line at
        the second, so both are found here, before pyarrow sees the block.
        """
        broken = np.zeros(len(nl), bool)
        if len(nl) == 0:
            return broken

        def field_of(pos: int, i: int) -> str:
            k = int(np.searchsorted(tabs, pos) - np.searchsorted(tabs, starts[i]))  # 0-based field
            return f"field {k + 1} ({names[k]})" if k < len(names) else f"field {k + 1}"

        try:
            block.decode("utf-8")
        except UnicodeDecodeError as e:  # the rare case: find every such line, one decode per line
            for i in range(int(np.searchsorted(nl, e.start)), len(nl)):
                try:
                    block[starts[i] : nl[i] + 1].decode("utf-8")
                except UnicodeDecodeError as le:
                    pos = int(starts[i]) + le.start
                    broken[i] = True
                    self._bad(
                        path, int(line_idx[i]), "utf8", f"invalid UTF-8 byte 0x{buf[pos]:02x} in {field_of(pos, i)}"
                    )
        cr = np.flatnonzero(buf == 13)
        if len(cr):
            stray = cr[buf[np.minimum(cr + 1, len(buf) - 1)] != 10]  # "\r\n" is a line end, any other "\r" is not
            stray = stray[stray < nl[-1]]
            lines = np.searchsorted(nl, stray)
            for pos, i in zip(stray.tolist(), lines.tolist()):
                if not broken[i]:
                    broken[i] = True
                    self._bad(
                        path,
                        int(line_idx[i]),
                        "cr",
                        f"a carriage return (\\r) inside the line, in {field_of(pos, i)}; "
                        "lines must end in \\n or \\r\\n",
                    )
        return broken

    def parse_block(self, path: Path, first_line: int, block: bytes) -> Optional[RawChunk]:
        """Parse whole lines (``block``, first line index ``first_line``) into raw columns.

        Bad lines are dropped and counted (or raise under strict); None if none is left.
        """
        has_label = self.has_label()
        ncols = TSV_COLUMNS_WITH_LABEL if has_label else TSV_COLUMNS_WITHOUT_LABEL
        names = ([LABEL_NAME] if has_label else []) + INT_NAMES + CAT_NAMES

        read = pacsv.ReadOptions(column_names=names, block_size=1 << 22)
        parse = pacsv.ParseOptions(
            delimiter="\t", quote_char=False, double_quote=False, escape_char=False, ignore_empty_lines=False
        )
        typed = {n: pa.string() for n in names}
        typed.update({n: pa.int64() for n in ([LABEL_NAME] if has_label else []) + INT_NAMES})
        typed_opts = pacsv.ConvertOptions(column_types=typed, null_values=[""], strings_can_be_null=False)

        # 1. fast path: typed columnar parse; pyarrow reports rows with a wrong field count
        #    (an empty line is not reported, so look for one first)
        table: Optional[pa.Table] = None
        if not (block.startswith(b"\n") or b"\n\n" in block):
            invalid: List[int] = []
            fast = pacsv.ParseOptions(
                delimiter="\t",
                quote_char=False,
                double_quote=False,
                escape_char=False,
                ignore_empty_lines=False,
                invalid_row_handler=lambda row: invalid.append(1) or "skip",
            )
            try:
                table = pacsv.read_csv(io.BytesIO(block), read, fast, typed_opts)
            except pa.ArrowInvalid:
                table = None
            if invalid or (table is not None and table.num_rows != block.count(b"\n")):
                table = None  # a wrong field count, or a stray "\r" that pyarrow took for a line end
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
            starts = np.concatenate([[0], nl[:-1] + 1])
            broken = self._broken_lines(path, block, buf, nl, starts, tabs, line_idx, names)
            wrong = (fields != ncols) & ~broken
            for i in np.flatnonzero(wrong):
                self._bad(
                    path, int(line_idx[i]), "fields", f"wrong number of fields: {int(fields[i])}, expected {ncols}"
                )
            wrong |= broken
            if wrong.any():
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
                table = pacsv.read_csv(
                    io.BytesIO(block),
                    read,
                    parse,
                    pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=False),
                )
                int_cols = {}
                for n in INT_NAMES:
                    col = table.column(n)
                    ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, _INT_PATTERN)).to_numpy(
                        zero_copy_only=False
                    )
                    for i in np.flatnonzero(~ok & ~bad):
                        self._bad(
                            path, int(line_idx[i]), "int", f"non-integer dense feature {n}={col[int(i)].as_py()!r}"
                        )
                    bad |= ~ok
                    clean = pc.if_else(pa.array(ok), col, "")
                    int_cols[n] = pc.cast(pc.if_else(pc.equal(clean, ""), None, clean), pa.int64())
                if has_label:
                    lab = table.column(LABEL_NAME)
                    ok = pc.match_substring_regex(lab, r"^[01]$").to_numpy(zero_copy_only=False)
                    table = table.set_column(0, LABEL_NAME, pc.cast(pc.if_else(pa.array(ok), lab, "0"), pa.int64()))
                    for i in np.flatnonzero(~ok & ~bad):
                        self._bad(
                            path, int(line_idx[i]), "label", f"bad label {lab[int(i)].as_py()!r}, expected 0 or 1"
                        )
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

    def _open(self, path: Path) -> pq.ParquetFile:
        """Open and check the columns: present, integer typed (label: integer or float)."""
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:  # not Parquet, or a footer cut short
            raise BadInputError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from e
        schema = pf.schema_arrow
        expected = ([(LABEL_NAME, "int8")] if LABEL_NAME in schema.names else []) + [
            (n, "int64") for n in INT_NAMES + CAT_NAMES
        ]
        for name, want in expected:
            if name not in schema.names:
                raise BadInputError(
                    f"{path}: column {name!r} is missing (expected {want}); the columns are those "
                    "written by data/preprocess_criteo.py: label, int_0 .. int_12, cat_0 .. cat_25"
                )
            t = schema.field(name).type
            if not (pa.types.is_integer(t) or (name == LABEL_NAME and pa.types.is_floating(t))):
                what = "raw 32-bit category ids" if name in CAT_NAMES else "raw integer values"
                raise BadInputError(
                    f"{path}: column {name!r} has type {t}, expected {want} ({what}, null = missing, "
                    "as data/preprocess_criteo.py writes); hex strings must be preprocessed first"
                )
        return pf

    def _count_file_rows(self) -> List[int]:
        return [self._open(p).metadata.num_rows for p in self.paths]

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[Chunk]:
        pf = self._open(self.paths[file_idx])
        meta = pf.metadata
        hi = meta.num_rows if hi is None else hi
        if meta.num_rows == 0 and self._file_rows_cache is None:
            self._empty_file(self.paths[file_idx])
        has_label = LABEL_NAME in pf.schema_arrow.names
        base = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if base < hi and base + n > lo:
                yield from self._read_row_group(pf, self.paths[file_idx], g, base, lo, hi, has_label)
            base += n

    def _read_row_group(
        self, pf: pq.ParquetFile, path: Path, group: int, first: int, lo: int, hi: int, has_label: bool
    ) -> Iterator[Chunk]:
        """Rows [lo, hi) of row group ``group`` (whose first row is ``first``). A group that
        cannot be decoded (corrupt pages) is a BadInputError naming the file and the group
        (strict), or is skipped with a warning and counted (skip); rows it gave before the
        damage are kept."""
        pos = first  # row index of the next row the iterator returns
        try:
            for rb in pf.iter_batches(batch_size=self.config.chunk_rows, row_groups=[group]):
                a, b = max(lo - pos, 0), min(hi - pos, rb.num_rows)
                pos += rb.num_rows
                if a < b:
                    yield self._convert(rb.slice(a, b - a), has_label)
                if pos >= hi:
                    return
        except (OSError, pa.ArrowException) as e:
            msg = (
                f"{path}: row group {group} (rows {first}.."
                f"{first + pf.metadata.row_group(group).num_rows - 1}) cannot be decoded after row {pos}: "
                f"{type(e).__name__}: {e}"
            )
            if self.config.bad_input == "strict":
                raise BadInputError(msg) from e
            self.stats.damaged_row_groups += 1
            logger.warning("skipping the rest of a damaged row group (bad_input=skip): %s", msg)

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

    def _load(self, path: Path) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Memory-map and check one triplet: shapes [N, 13], [N, 26], [N] or [N, 1], one N."""
        dense_p, sparse_p, labels_p = self._triplet(path)
        dense, sparse, labels = (_load_npy(q) for q in (dense_p, sparse_p, labels_p))
        for q, a, width, what in (
            (dense_p, dense, INT_FEATURE_COUNT, "dense features"),
            (sparse_p, sparse, CAT_FEATURE_COUNT, "category ids"),
        ):
            if a.ndim != 2 or a.shape[1] != width:
                raise BadInputError(f"{q}: shape {list(a.shape)}, expected [N, {width}] ({what}, one row per sample)")
        if not (labels.ndim == 1 or (labels.ndim == 2 and labels.shape[1] == 1)):
            raise BadInputError(
                f"{labels_p}: shape {list(labels.shape)}, expected [N] or [N, 1] (one label per row; "
                f"{dense_p.name} has N = {len(dense)})"
            )
        if not len(dense) == len(sparse) == len(labels):
            raise BadInputError(
                f"row counts differ: {dense_p} has {len(dense)} rows, {sparse_p} {len(sparse)}, "
                f"{labels_p} {len(labels)}; the three files of a day must hold the same rows"
            )
        return dense, sparse, labels

    def _count_file_rows(self) -> List[int]:
        return [len(self._load(p)[0]) for p in self.paths]

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[Chunk]:
        dense_p = self.paths[file_idx]
        dense, sparse, labels = self._load(dense_p)
        hi = len(dense) if hi is None else hi
        if len(dense) == 0 and self._file_rows_cache is None:
            self._empty_file(dense_p)
        for a in range(lo, hi, self.config.chunk_rows):
            b = min(a + self.config.chunk_rows, hi)
            d = np.asarray(dense[a:b])
            d = d.astype(np.float32) if self.config.dense_is_transformed else dense_transform(d.astype(np.int64))
            s = np.asarray(sparse[a:b]).astype(np.int64)
            yield np.asarray(labels[a:b]).reshape(-1).astype(np.float32), d, s, np.zeros(s.shape, bool)
