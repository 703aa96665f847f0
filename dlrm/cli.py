"""Train a (compressed) DLRM on Criteo or synthetic Criteo-shaped data.

    comera-train-dlrm --config dlrm_demo [section.key=value ...]
    comera-train-dlrm --config configs/dlrm_demo.yaml --resume
    torchrun --nproc_per_node=2 -m comera_rec.dlrm.cli --config dlrm_demo

From a checkout the same command is ``python launch/train_dlrm.py``. ``--config`` takes a
path or the name of a shipped config (``dlrm_demo``, ``dlrm_criteo_kaggle``, ...: the
files of configs/). Every field of every section is documented in docs/training.md and
docs/dlrm.md; `--help-config` prints them with their current values.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from comera_rec.config import run_config_from_args
from comera_rec.dlrm.task import DLRMRunConfig, DLRMTask
from comera_rec.training import Trainer
from comera_rec.utils.logs import setup_logging


def train(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv`` (``None``: ``sys.argv[1:]``), train, and return the run's summary
    (``{}`` after ``--help-config``). ``launch/train_dlrm.py`` and ``comera-train-dlrm``
    both run this."""
    setup_logging()
    config = run_config_from_args(
        DLRMRunConfig,
        argv,
        __doc__,
        overrides_help="section.key=value, e.g. trainer.max_steps=200 model.rank=16",
    )
    if config is None:  # --help-config
        return {}
    task = DLRMTask(config)
    return Trainer(task, config.trainer, config.schedule, config.optim, run_config=config).fit()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``comera-train-dlrm`` console script: :func:`train`, exit status 0."""
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
