"""Train the BERT4Rec-style masked-item sequence model (TT or dense item table), from a checkout.

    python launch/train_seq.py --config configs/seq_synthetic.yaml
    python launch/train_seq.py --config configs/seq_synthetic.yaml model.compressed=false
    python launch/train_seq.py --config configs/seq_movielens.yaml data.source=/data/ml-1m/ratings.dat

Runs :func:`comera_rec.sequence.task.train`. Fields: docs/sequence.md (model, data) and
docs/training.md (trainer, schedule, optim); `--help-config` prints the resolved config.
"""

from __future__ import annotations

from comera_rec.sequence.task import train as main

if __name__ == "__main__":
    main()
