"""Train the BERT-style sentence-pair classifier (compressed, dense, GaLore or LTE).

    python launch/train_transformer.py --config configs/transformer_synthetic.yaml
    python launch/train_transformer.py --config configs/transformer_synthetic.yaml method.name=dense
    python launch/train_transformer.py --config configs/transformer_mnli.yaml data.source=/data/MNLI
    torchrun --nproc_per_node=2 launch/train_transformer.py --config configs/transformer_synthetic.yaml

Fields: docs/transformer.md (model, data, method) and docs/training.md (trainer,
schedule, optim); `--help-config` prints the resolved config.
"""

from __future__ import annotations

import argparse

import yaml

from comera_rec.config import load_config, to_dict
from comera_rec.transformer.runs import ClassificationRun, run_classification


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (configs/transformer_*.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in trainer.run_dir")
    parser.add_argument("--help-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. method.name=galore trainer.max_steps=50")
    args = parser.parse_args(argv)
    config = load_config(ClassificationRun, args.config, args.overrides + (["trainer.resume=true"] if args.resume else []))
    if args.help_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False))
        return {}
    summary = run_classification(config)
    print(f"{config.method.name}: val accuracy {summary['val_accuracy']:.4f}, val loss {summary['val_log_loss']:.4f}, "
          f"compression {summary['compression']:.1f}x, {summary['parameters']:,} parameters")
    return summary


if __name__ == "__main__":
    main()
