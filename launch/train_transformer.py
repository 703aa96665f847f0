"""Train the BERT-style sentence-pair classifier (compressed, dense, GaLore or LTE).

    python launch/train_transformer.py --config configs/transformer_synthetic.yaml
    python launch/train_transformer.py --config configs/transformer_synthetic.yaml method.name=dense
    python launch/train_transformer.py --config configs/transformer_mnli.yaml data.source=/data/MNLI
    torchrun --nproc_per_node=2 launch/train_transformer.py --config configs/transformer_synthetic.yaml

Fields: docs/transformer.md (model, data, method) and docs/training.md (trainer,
schedule, optim); `--help-config` prints the resolved config.
"""

from __future__ import annotations

from comera_rec.config import run_config_from_args
from comera_rec.transformer.runs import ClassificationRun, run_classification
from comera_rec.utils.logs import setup_logging


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    config = run_config_from_args(
        ClassificationRun, argv, __doc__, config_help="YAML run config (configs/transformer_*.yaml)",
        overrides_help="section.key=value, e.g. method.name=galore trainer.max_steps=50",
    )
    if config is None:  # --help-config
        return {}
    summary = run_classification(config)
    print(f"{config.method.name}: val accuracy {summary['val_accuracy']:.4f}, val loss {summary['val_log_loss']:.4f}, "
          f"compression {summary['compression']:.1f}x, {summary['parameters']:,} parameters")
    return summary


if __name__ == "__main__":
    main()
