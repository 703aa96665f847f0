"""Train the BERT-style sentence-pair classifier (compressed, dense, GaLore or LTE), from a checkout.

    python launch/train_transformer.py --config configs/transformer_synthetic.yaml
    python launch/train_transformer.py --config configs/transformer_synthetic.yaml method.name=dense
    python launch/train_transformer.py --config configs/transformer_mnli.yaml data.source=/data/MNLI
    torchrun --nproc_per_node=2 launch/train_transformer.py --config configs/transformer_synthetic.yaml

The same as the installed console script ``comera-train-transformer``: both run
:func:`comera_rec.transformer.cli.train`. Fields: docs/transformer.md (model, data,
method) and docs/training.md (trainer, schedule, optim); `--help-config` prints the
resolved config.
"""

from __future__ import annotations

from comera_rec.transformer.cli import train as main

if __name__ == "__main__":
    main()
