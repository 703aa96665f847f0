"""Train the BERT-style sentence-pair classifier (compressed, dense, GaLore or LTE).

    comera-train-transformer --config transformer_synthetic
    comera-train-transformer --config transformer_synthetic method.name=dense
    comera-train-transformer --config transformer_mnli data.source=/data/MNLI
    torchrun --nproc_per_node=2 -m comera_rec.transformer.cli --config transformer_synthetic

From a checkout the same command is ``python launch/train_transformer.py``. ``--config``
takes a path or the name of a shipped config (the files of configs/). Fields:
docs/transformer.md (model, data, method) and docs/training.md (trainer, schedule,
optim); `--help-config` prints the resolved config.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from comera_rec.config import run_config_from_args
from comera_rec.transformer.runs import ClassificationRun, run_classification
from comera_rec.utils.logs import setup_logging


def train(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` (``None``: ``sys.argv[1:]``), train, print one line and return the
    summary (``{}`` after ``--help-config``). ``launch/train_transformer.py`` and
    ``comera-train-transformer`` both run this."""
    setup_logging()
    config = run_config_from_args(
        ClassificationRun,
        argv,
        __doc__,
        config_help="YAML run config: a path, or a shipped config's name (transformer_synthetic, ...)",
        overrides_help="section.key=value, e.g. method.name=galore trainer.max_steps=50",
    )
    if config is None:  # --help-config
        return {}
    summary = run_classification(config)
    print(
        f"{config.method.name}: val accuracy {summary['val_accuracy']:.4f}, val loss {summary['val_log_loss']:.4f}, "
        f"compression {summary['compression']:.1f}x, {summary['parameters']:,} parameters"
    )
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``comera-train-transformer`` console script: :func:`train`, exit status 0."""
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
