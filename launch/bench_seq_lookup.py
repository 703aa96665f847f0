"""Sequence lookup benchmark from a checkout: TTMEmbeddingCollection against TorchRec's
EmbeddingCollection (FBGEMM, row-wise Adagrad fused into backward) on one large item table.

    python launch/bench_seq_lookup.py            # 10M items, dim 64, sequence lengths 50 and 200
    python launch/bench_seq_lookup.py --quick    # 100k items: a smoke run

Runs :func:`comera_rec.sequence.bench.main`, whose help (``--help``) and module text say
what is measured and how.
"""

from __future__ import annotations

from comera_rec.sequence.bench import main

if __name__ == "__main__":
    main()
