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

# The readers live in reader_base, text_files, tsv_reader, parquet_reader and npy_reader;
# every name (the helpers too, under their public names) stays importable from here.
from comera_rec.data.npy_reader import CriteoNpyReader, load_npy  # noqa: F401
from comera_rec.data.parquet_reader import CriteoParquetReader  # noqa: F401
from comera_rec.data.reader_base import (  # noqa: F401
    BadInputError,
    Chunk,
    CriteoReaderBase,
    CriteoReaderConfig,
    RawChunk,
    ReaderStats,
    logger,
)
from comera_rec.data.text_files import (  # noqa: F401
    GZIP_STREAM_ERRORS,
    compressed_pos,
    count_lines,
    count_lines_with_damage,
    damage_message,
    open_binary,
    read_block,
)
from comera_rec.data.tsv_reader import INT_PATTERN, MAX_LOGGED_BAD_LINES, CriteoTsvReader  # noqa: F401
