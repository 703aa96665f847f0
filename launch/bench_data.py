"""Data pipeline throughput: rows per second per process, next to pandas.read_csv.

Writes ``--rows`` synthetic Criteo rows to a temporary folder (TSV with hex categories
and integer dense values, its Parquet conversion by the preprocessing code, and
TorchRec's npy layout), then times on the same data:

- ``pandas.read_csv`` with explicit dtypes (parse only: no transforms, no batches),
- our TSV reader (parse, validate, transform, hash, build Batches),
- our Parquet reader (read, transform, vocabulary remap, build Batches),
- our npy reader,
- the synthetic generator streaming Batches.

The folder is removed at the end. Example::

    python launch/bench_data.py --rows 200000 --batch-size 2048 --train-rows-per-s 50000
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from comera_rec.data import (
    KAGGLE_NUM_EMBEDDINGS,
    CriteoNpyReader,
    CriteoParquetReader,
    CriteoReaderConfig,
    CriteoTsvReader,
    SyntheticCriteo,
    SyntheticCriteoConfig,
)
from comera_rec.data.preprocess import preprocess_tsv_to_parquet


def rows_per_s(make: Callable[[], Iterable], repeats: int) -> float:
    """Best of ``repeats`` passes: rows / second over one full iteration."""
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = 0
        for item in make():
            n += item.labels.shape[0] if hasattr(item, "labels") else len(item)
        best = max(best, n / (time.perf_counter() - t0))
    return best


def pandas_read(path: Path, chunk_rows: int) -> Iterable[pd.DataFrame]:
    dtypes = {0: "int8", **{1 + j: "float64" for j in range(13)}, **{14 + j: "str" for j in range(26)}}
    return pd.read_csv(path, sep="\t", header=None, dtype=dtypes, chunksize=chunk_rows, na_filter=True)


def main() -> None:
    p = argparse.ArgumentParser(description="Criteo data pipeline throughput")
    p.add_argument("--rows", type=int, default=200_000, help="synthetic rows to write and read")
    p.add_argument("--batch-size", type=int, default=2048, help="rows per batch")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per measurement (best is kept)")
    p.add_argument(
        "--train-rows-per-s", type=float, default=None, help="rows/s one training process consumes, to print the margin"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    tmp = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        gen = SyntheticCriteo(SyntheticCriteoConfig(batch_size=args.batch_size, num_rows=args.rows, seed=0))
        t0 = time.perf_counter()
        tsv = gen.write_tsv(tmp / "synth.tsv", args.rows)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        preprocess_tsv_to_parquet([str(tsv)], str(tmp / "pq"), progress=False)
        t_pre = time.perf_counter() - t0
        pq_path = tmp / "pq" / "synth.parquet"
        # npy in TorchRec's layout: dense already log-transformed, raw sparse ids, labels [N, 1]
        dense, sparse, labels = [], [], []
        for b in gen:
            dense.append(b.dense_features.numpy())
            sparse.append(b.sparse_features.values().numpy().reshape(26, -1).T)
            labels.append(b.labels.numpy())
        np.save(tmp / "synth_dense.npy", np.concatenate(dense))
        np.save(tmp / "synth_sparse.npy", np.concatenate(sparse).astype(np.int32))
        np.save(tmp / "synth_labels.npy", np.concatenate(labels).astype(np.int32).reshape(-1, 1))
        mb = tsv.stat().st_size / 2**20
        print(
            f"data: {args.rows} rows, TSV {mb:.1f} MiB (written in {t_write:.2f} s), Parquet {pq_path.stat().st_size / 2**20:.1f} MiB "
            f"(preprocessing {args.rows / t_pre:,.0f} rows/s), batch size {args.batch_size}"
        )

        bs = args.batch_size
        results = {}
        results["pandas.read_csv (parse only)"] = rows_per_s(lambda: pandas_read(tsv, 1 << 16), args.repeats)
        results["TSV reader (Batches, hashed ids)"] = rows_per_s(
            lambda: CriteoTsvReader(
                CriteoReaderConfig(paths=[str(tsv)], batch_size=bs, num_embeddings_per_feature=KAGGLE_NUM_EMBEDDINGS)
            ),
            args.repeats,
        )
        results["Parquet reader (Batches, vocab ids)"] = rows_per_s(
            lambda: CriteoParquetReader(
                CriteoReaderConfig(paths=[str(pq_path)], batch_size=bs, vocab_dir=str(tmp / "pq"))
            ),
            args.repeats,
        )
        results["Parquet reader (Batches, hashed ids)"] = rows_per_s(
            lambda: CriteoParquetReader(
                CriteoReaderConfig(
                    paths=[str(pq_path)], batch_size=bs, num_embeddings_per_feature=KAGGLE_NUM_EMBEDDINGS
                )
            ),
            args.repeats,
        )
        results["npy reader (Batches)"] = rows_per_s(
            lambda: CriteoNpyReader(CriteoReaderConfig(paths=[str(tmp / "synth_dense.npy")], batch_size=bs)),
            args.repeats,
        )
        results["synthetic generator (Batches)"] = rows_per_s(
            lambda: SyntheticCriteo(SyntheticCriteoConfig(batch_size=bs, num_rows=args.rows, seed=1)), args.repeats
        )
        base = results["pandas.read_csv (parse only)"]
        print(
            f"{'pipeline':40s} {'rows/s':>12s} {'x pandas':>9s}"
            + (f" {'x training':>11s}" if args.train_rows_per_s else "")
        )
        for name, r in results.items():
            line = f"{name:40s} {r:12,.0f} {r / base:9.2f}"
            if args.train_rows_per_s:
                line += f" {r / args.train_rows_per_s:11.1f}"
            print(line)
        print(f"synthetic generator Bayes-optimal AUC: {gen.bayes_auc():.4f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
