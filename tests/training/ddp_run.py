"""Launched by torchrun from test_training_engine.py: 2 processes, gloo, DDP, truncation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from toy_task import ToyTask  # noqa: E402

from comera_rec.rank import RankScheduleConfig  # noqa: E402
from comera_rec.training import OptimConfig, Trainer, TrainerConfig  # noqa: E402


class RecordingTask(ToyTask):
    def __init__(self, out: Path) -> None:
        super().__init__(batches_per_epoch=6, nan_batches=(4,))
        self.out = out


def main() -> None:
    run_dir = Path(sys.argv[1])
    task = RecordingTask(run_dir)
    trainer = Trainer(
        task,
        TrainerConfig(
            run_dir=str(run_dir), max_steps=10, log_every=2, eval_every=5, checkpoint_every=5, progress=False, seed=3
        ),
        RankScheduleConfig(mode="threshold", threshold=0.999, truncate_every=4, late_stage=True, switch_step=6),
        OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2),
    )
    # close() runs in fit(); keep what we compare before it drops the group
    orig_close = trainer.close

    def close() -> None:
        rank = dist.get_rank()
        params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save(params, run_dir / f"params_rank{rank}.pt")
        (run_dir / f"ranks_rank{rank}.json").write_text(
            json.dumps({"losses": trainer.losses, "nonfinite": trainer.nonfinite, "truncations": trainer.truncations})
        )
        orig_close()

    trainer.close = close  # type: ignore[method-assign]
    trainer.fit()
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
