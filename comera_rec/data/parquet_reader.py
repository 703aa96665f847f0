"""The reader of the Criteo Parquet files that preprocessing writes (re-exported by
:mod:`comera_rec.data.readers`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from comera_rec.data.criteo import CAT_FEATURE_COUNT, CAT_NAMES, INT_FEATURE_COUNT, INT_NAMES, LABEL_NAME, NO_LABEL
from comera_rec.data.reader_base import BadInputError, Chunk, CriteoReaderBase, NumberedChunk
from comera_rec.data.transforms import dense_transform

logger = logging.getLogger("comera_rec.data.readers")  # the readers' logger name before the split into modules


class CriteoParquetReader(CriteoReaderBase):
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

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[NumberedChunk]:
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
    ) -> Iterator[NumberedChunk]:
        """Rows [lo, hi) of row group ``group`` (whose first row is ``first``). A group that
        cannot be decoded (corrupt pages) is a BadInputError naming the file and the group
        (strict), or is skipped with a warning and counted (skip); rows it gave before the
        damage are kept."""
        pos = first  # row index of the next row the iterator returns
        try:
            for rb in pf.iter_batches(batch_size=self.config.chunk_rows, row_groups=[group]):
                a, b = max(lo - pos, 0), min(hi - pos, rb.num_rows)
                if a < b:
                    yield np.arange(pos + a, pos + b), self._convert(rb.slice(a, b - a), has_label)
                pos += rb.num_rows
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
