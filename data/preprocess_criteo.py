"""Turn Criteo TSV (Kaggle train.txt / test.txt, Terabyte day_N; plain or gzip) into Parquet.

Writes ``OUT/<name>.parquet`` per input, ``OUT/vocab/cat_*.npy`` (contiguous
vocabularies) and ``OUT/table_sizes.json`` (``num_embeddings_per_feature`` for the model
config). One streaming pass over the input; memory is bounded by the chunk size and the
vocabulary counts. The logic lives in ``comera_rec.data.preprocess``.

Example::

    python data/preprocess_criteo.py /data/criteo/train.txt --out /data/criteo_pq --frequency-threshold 3
    python data/preprocess_criteo.py /data/tb/day_{0..23}.gz --out /data/tb_pq --frequency-threshold 15
"""

from __future__ import annotations

import argparse
import json

from comera_rec.data.preprocess import preprocess_tsv_to_parquet
from comera_rec.utils.logs import setup_logging


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="Criteo TSV files, plain or gzip, in row order")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--frequency-threshold", type=int, default=1, help="ids seen fewer times share the rare bucket (id 1)"
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad line (default: skip and count)")
    p.add_argument(
        "--has-label", choices=["auto", "yes", "no"], default="auto", help="first column is the label (test.txt: no)"
    )
    p.add_argument("--row-group-rows", type=int, default=1 << 18, help="Parquet row group size")
    p.add_argument("--chunk-mb", type=int, default=16, help="MiB of text parsed per step")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args()
    setup_logging()
    meta = preprocess_tsv_to_parquet(
        args.inputs,
        args.out,
        frequency_threshold=args.frequency_threshold,
        bad_input="strict" if args.strict else "skip",
        has_label={"auto": None, "yes": True, "no": False}[args.has_label],
        row_group_rows=args.row_group_rows,
        chunk_bytes=args.chunk_mb << 20,
        progress=not args.no_progress,
    )
    print(json.dumps({k: meta[k] for k in ("num_embeddings_per_feature", "rows_per_file", "bad_lines")}))


if __name__ == "__main__":
    main()
