"""Train a (compressed) DLRM on Criteo or synthetic Criteo-shaped data.

    python launch/train_dlrm.py --config configs/dlrm_demo.yaml [section.key=value ...]
    torchrun --nproc_per_node=2 launch/train_dlrm.py --config configs/dlrm_demo.yaml
    python launch/train_dlrm.py --config configs/dlrm_demo.yaml --resume

Every field of every section is documented in docs/training.md and docs/dlrm.md;
`--help-config` prints them with their current values.
"""

from __future__ import annotations

import argparse
import logging

from comera_rec.config import to_dict
from comera_rec.training import Trainer
from dlrm.task import DLRMTask, load_run_config


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (configs/*.yaml); defaults apply without one")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in trainer.run_dir")
    parser.add_argument("--help-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. trainer.max_steps=200 model.rank=16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_run_config(args.config, args.overrides + (["trainer.resume=true"] if args.resume else []))
    if args.help_config:
        import yaml

        print(yaml.safe_dump(to_dict(config), sort_keys=False))
        return {}
    task = DLRMTask(config)
    return Trainer(task, config.trainer, config.schedule, config.optim, run_config=config).fit()


if __name__ == "__main__":
    main()
