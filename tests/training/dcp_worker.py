"""Worker of test_checkpoint_resharding.py: the tiny DLRM run, alone or under torchrun.

    python tests/training/dcp_worker.py --config configs/dlrm_demo.yaml [--resume [--save-on-resume]] [section.key=value ...]

The same as launch/train_dlrm.py, except that ``embedding_optim.sharding_type=column_wise``
splits every table into column shards of 4 (TorchRec's planner keeps columns of at least
128 together, which would leave the tiny run's 8-wide tables whole), and that
``--save-on-resume`` writes the checkpoint of the step it resumed at again before the first
step (the state as this run's processes and plan hold it), then trains on.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_modules import EmbeddingBagCollection

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from comera_rec.config import run_config_from_args  # noqa: E402
from comera_rec.dlrm.task import DLRMRunConfig, DLRMTask  # noqa: E402
from comera_rec.integration.distributed import wrap_model  # noqa: E402
from comera_rec.training import Trainer  # noqa: E402
from comera_rec.utils.logs import setup_logging  # noqa: E402


class SplitColumnsTask(DLRMTask):
    """DLRM whose column-wise plan really splits the 8-wide tables (two shards of 4)."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """As :meth:`DLRMTask.wrap`, with 4-column shards under ``column_wise``."""
        if self.config.embedding_optim.sharding_type != "column_wise" or self._wrapped is not None:
            return super().wrap(model)
        names = [
            cfg.name
            for _, m in model.named_modules()
            if type(m) is EmbeddingBagCollection
            for cfg in m.embedding_bag_configs()
        ]
        constraints = {n: ParameterConstraints(sharding_types=["column_wise"], min_partition=4) for n in names}
        self._wrapped, self.fused_optimizer = wrap_model(
            model,
            device=self.device,
            embedding_optimizer=self.config.embedding_optim.spec(),
            sharding_type="column_wise",
            constraints=constraints,
        )
        return self._wrapped


class SaveOnResumeTrainer(Trainer):
    """A :class:`Trainer` that, resuming, writes the checkpoint it resumed from again before
    its first step (one launch checks the state loaded and trains on from it)."""

    def _start_run(self):
        started = super()._start_run()
        if self.config.resume:
            self.save()
        return started


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train the tiny DLRM as launch/train_dlrm.py does, with :class:`SplitColumnsTask`."""
    setup_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    trainer = SaveOnResumeTrainer if "--save-on-resume" in args else Trainer
    config = run_config_from_args(DLRMRunConfig, [a for a in args if a != "--save-on-resume"], __doc__)
    trainer(SplitColumnsTask(config), config.trainer, config.schedule, config.optim, run_config=config).fit()


if __name__ == "__main__":
    main()
