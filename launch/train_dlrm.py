"""Train a (compressed) DLRM on Criteo or synthetic Criteo-shaped data.

    python launch/train_dlrm.py --config configs/dlrm_demo.yaml [section.key=value ...]
    torchrun --nproc_per_node=2 launch/train_dlrm.py --config configs/dlrm_demo.yaml
    python launch/train_dlrm.py --config configs/dlrm_demo.yaml --resume

Every field of every section is documented in docs/training.md and docs/dlrm.md;
`--help-config` prints them with their current values.
"""

from __future__ import annotations

from comera_rec.config import run_config_from_args
from comera_rec.training import Trainer
from comera_rec.utils.logs import setup_logging
from dlrm.task import DLRMRunConfig, DLRMTask


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    config = run_config_from_args(
        DLRMRunConfig, argv, __doc__,
        overrides_help="section.key=value, e.g. trainer.max_steps=200 model.rank=16",
    )
    if config is None:  # --help-config
        return {}
    task = DLRMTask(config)
    return Trainer(task, config.trainer, config.schedule, config.optim, run_config=config).fit()


if __name__ == "__main__":
    main()
