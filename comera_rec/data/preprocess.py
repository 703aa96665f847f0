"""Criteo TSV -> Parquet with contiguous vocabularies, in one streaming pass.

For each input file ``X`` (``train.txt``, ``day_0.gz``, ...) one pass parses the lines
(the TSV reader's vectorised parser and bad-input policy), writes ``out/X.parquet``
(raw values: ``label`` int8, ``int_*`` int64 with null = missing, ``cat_*`` int64 raw
32-bit ids with null = missing) and counts every id. After the last file the
vocabularies (ids seen at least ``frequency_threshold`` times, over all input rows as in
the DLRM reference and TorchRec) go to ``out/vocab/cat_*.npy`` and the table sizes
(``len(vocab) + 2``: id 0 = missing, 1 = rare / unseen) to ``out/table_sizes.json``.
The contiguous remap is applied when reading (``CriteoParquetReader`` with
``vocab_dir=out``), so the TSV is read exactly once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from comera_rec.data.criteo import CAT_NAMES, INT_NAMES, LABEL_NAME
from comera_rec.data.readers import CriteoReaderConfig, CriteoTsvReader, RawChunk
from comera_rec.data.transforms import IdCounter, save_vocabularies

logger = logging.getLogger(__name__)


def _is_gzip(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def output_name(path: str | Path) -> str:
    """Parquet file name for an input: ``train.txt`` -> ``train.parquet``, ``day_3.gz`` -> ``day_3.parquet``."""
    name = Path(path).name
    for suffix in (".gz", ".txt", ".tsv"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name + ".parquet"


def _raw_table(chunk: RawChunk, has_label: bool) -> pa.Table:
    labels, dense_raw, dense_missing, cat_raw, cat_missing = chunk
    cols, names = [], []
    if has_label:
        cols.append(pa.array(labels.astype(np.int8)))
        names.append(LABEL_NAME)
    for j, name in enumerate(INT_NAMES):
        cols.append(pa.array(dense_raw[:, j], type=pa.int64(), mask=dense_missing[:, j]))
        names.append(name)
    for j, name in enumerate(CAT_NAMES):
        cols.append(pa.array(cat_raw[:, j], type=pa.int64(), mask=cat_missing[:, j]))
        names.append(name)
    return pa.table(cols, names=names)


def preprocess_tsv_to_parquet(
    inputs: List[str],
    out_dir: str,
    frequency_threshold: int = 1,
    bad_input: str = "skip",
    has_label: Optional[bool] = None,
    row_group_rows: int = 1 << 18,
    chunk_bytes: int = 16 << 20,
    progress: bool = True,
) -> Dict:
    """Convert Criteo TSV files to Parquet and write vocabularies and table sizes.

    Args:
        inputs: TSV files (plain or gzip), e.g. ``["train.txt"]`` or ``day_0 .. day_23``.
        out_dir: output folder (created).
        frequency_threshold: ids seen fewer times share the rare bucket (id 1).
        bad_input: "skip" (drop, count, log) or "strict" (raise with file and line).
        has_label: whether lines start with a label; None = detect (test.txt has none).
        row_group_rows: Parquet row group size (the Parquet reader's unit of sharding).
        chunk_bytes: bytes parsed per step (bounds memory).
        progress: show a tqdm progress bar.

    Returns:
        the content of ``table_sizes.json`` (plus ``rows_per_file`` and ``bad_lines``).

    Example::

        meta = preprocess_tsv_to_parquet(["train.txt"], "criteo_pq", frequency_threshold=3)
        meta["num_embeddings_per_feature"]  # 26 table sizes for the model config
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = CriteoTsvReader(
        CriteoReaderConfig(paths=list(inputs), bad_input=bad_input, has_label=has_label, chunk_bytes=chunk_bytes)
    )
    labelled = reader.has_label()
    counter = IdCounter()
    rows_per_file: Dict[str, int] = {}
    total_bytes = sum(os.path.getsize(p) for p in inputs)
    any_gzip = any(_is_gzip(p) for p in inputs)
    bar = tqdm(
        total=None if any_gzip else total_bytes, unit="B", unit_scale=True, disable=not progress, desc="preprocess"
    )
    for i, path in enumerate(inputs):
        target = out / output_name(path)
        writer: Optional[pq.ParquetWriter] = None
        pending: List[pa.Table] = []
        pending_rows, rows = 0, 0
        for nbytes, chunk in reader.read_raw(i):
            bar.update(nbytes)
            if chunk is None or not len(chunk[0]):
                continue
            counter.add(chunk[3], chunk[4])
            pending.append(_raw_table(chunk, labelled))
            pending_rows += len(chunk[0])
            rows += len(chunk[0])
            while pending_rows >= row_group_rows:
                table = pa.concat_tables(pending)
                if writer is None:
                    writer = pq.ParquetWriter(str(target), table.schema)
                writer.write_table(table.slice(0, row_group_rows), row_group_size=row_group_rows)
                pending = [table.slice(row_group_rows)]
                pending_rows -= row_group_rows
        if pending_rows or writer is None:
            table = (
                pa.concat_tables(pending)
                if pending
                else _raw_table(
                    (
                        np.zeros(0, np.float32),
                        np.zeros((0, 13), np.int64),
                        np.zeros((0, 13), bool),
                        np.zeros((0, 26), np.int64),
                        np.zeros((0, 26), bool),
                    ),
                    labelled,
                )
            )
            if writer is None:
                writer = pq.ParquetWriter(str(target), table.schema)
            writer.write_table(table, row_group_size=row_group_rows)
        writer.close()
        rows_per_file[target.name] = rows
        logger.info("%s -> %s: %d rows", path, target, rows)
    bar.close()
    vocabs = counter.vocabularies(frequency_threshold)
    meta = save_vocabularies(
        out,
        vocabs,
        frequency_threshold,
        extra={
            "rows_per_file": rows_per_file,
            "bad_lines": reader.stats.bad_lines,
            "sources": [str(p) for p in inputs],
        },
    )
    if reader.stats.bad_lines:
        logger.warning("skipped %d bad lines in total (%s)", reader.stats.bad_lines, reader.stats.bad_by_reason)
    if reader.stats.damaged_files:
        logger.warning(
            "%d input files had a damaged gzip stream and were read up to the damage only", reader.stats.damaged_files
        )
    return meta
