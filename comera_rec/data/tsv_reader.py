"""The Criteo TSV reader (plain or gzip), with its bad-line checks (re-exported by
:mod:`comera_rec.data.readers`)."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from comera_rec.data.criteo import (
    CAT_FEATURE_COUNT,
    CAT_NAMES,
    INT_FEATURE_COUNT,
    INT_NAMES,
    LABEL_NAME,
    NO_LABEL,
    TSV_COLUMNS_WITH_LABEL,
    TSV_COLUMNS_WITHOUT_LABEL,
)
from comera_rec.data.reader_base import BadInputError, CriteoReaderBase, CriteoReaderConfig, NumberedChunk, RawChunk
from comera_rec.data.text_files import compressed_pos, count_lines_with_damage, damage_message, open_binary, read_block
from comera_rec.data.transforms import dense_transform, parse_hex

logger = logging.getLogger("comera_rec.data.readers")  # the readers' logger name before the split into modules

MAX_LOGGED_BAD_LINES = 10
INT_PATTERN = r"^-?[0-9]{1,18}$"


class CriteoTsvReader(CriteoReaderBase):
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
            n, damage = count_lines_with_damage(p, 16 << 20)
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
                with open_binary(p) as f:
                    first, _ = read_block(f, 1 << 16)  # a damaged stream is reported when read
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
        with open_binary(path) as f:
            line, rest, err = 0, b"", None
            while line < lo:  # skip lines before this shard
                block, err = read_block(f, size)
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
                    block, err = read_block(f, size)
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
                self._damaged_file(path, damage_message(path, line, compressed_pos(f, path), err))

    # -- parsing ------------------------------------------------------------------------
    def _bad(self, path: Path, line_idx: int, reason: str, detail: str) -> None:
        msg = f"{path}:{line_idx + 1}: {detail}"
        if self.config.bad_input == "strict":
            raise BadInputError(msg)
        self.stats.bad_lines += 1
        self.stats.bad_by_reason[reason] = self.stats.bad_by_reason.get(reason, 0) + 1
        if self._logged_bad < MAX_LOGGED_BAD_LINES:
            logger.warning("skipping bad line %s", msg)
            self._logged_bad += 1
            if self._logged_bad == MAX_LOGGED_BAD_LINES:
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
        numbered = self.parse_block_numbered(path, first_line, block)
        return None if numbered is None else numbered[1]

    def parse_block_numbered(self, path: Path, first_line: int, block: bytes) -> Optional[Tuple[np.ndarray, RawChunk]]:
        """:meth:`parse_block` with the 0-based line index of every row kept ([n] int64)."""
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
                    ok = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, INT_PATTERN)).to_numpy(
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
            line_idx = line_idx[keep]
        return line_idx, (labels, dense_raw, dense_missing, cat_raw, cat_missing)

    def read_raw(self, file_idx: int, lo: int = 0, hi: Optional[int] = None) -> Iterator[Tuple[int, RawChunk]]:
        """(bytes consumed, raw chunk) for lines [lo, hi) of file ``file_idx`` (used by preprocessing)."""
        for nbytes, numbered in self._read_numbered(file_idx, lo, hi):
            yield nbytes, numbered[1] if numbered is not None else None  # type: ignore[misc]

    def _read_numbered(
        self, file_idx: int, lo: int, hi: Optional[int]
    ) -> Iterator[Tuple[int, Optional[Tuple[np.ndarray, RawChunk]]]]:
        """(bytes consumed, (line index per row, raw chunk) or None) for lines [lo, hi)."""
        path = self.paths[file_idx]
        n_before = self.stats.bad_lines
        any_line = False
        for first_line, block in self._line_blocks(path, lo, hi):
            any_line = True
            yield len(block), self.parse_block_numbered(path, first_line, block)
        if not any_line and lo == 0 and self._file_rows_cache is None:
            self._empty_file(path)
        if self.stats.bad_lines > n_before:
            logger.warning("%s: skipped %d bad lines", path, self.stats.bad_lines - n_before)

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[NumberedChunk]:
        for _, numbered in self._read_numbered(file_idx, lo, hi):
            if numbered is not None and len(numbered[0]):
                lines, (labels, dense_raw, _, cat_raw, cat_missing) = numbered
                yield lines, (labels, dense_transform(dense_raw), cat_raw, cat_missing)
