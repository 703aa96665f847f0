"""Worker of test_stop.py (alone or under torchrun): the toy task with uneven batches or slow steps.

    python tests/reliability/toy_run.py RUN_DIR [--steps N] [--uneven] [--slow S] [--resume]

Writes ``params_rankR.pt`` (the final model) and ``result_rankR.json`` (step, epoch,
losses) into RUN_DIR when fit() closes, whether it ends normally or on a signal. With
``--slow``, ``steps_started_rankR`` holds one line per training step begun, so that a test
can signal a step that is under way rather than one that has just ended.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from toy_task import ToyTask  # noqa: E402

from comera_rec.rank import RankScheduleConfig  # noqa: E402
from comera_rec.training import OptimConfig, Trainer, TrainerConfig  # noqa: E402
from comera_rec.utils.logs import setup_logging  # noqa: E402


class UnevenTask(ToyTask):
    """Rank 0 gets ``batches_per_epoch`` batches per epoch, every other rank two fewer;
    each training step sleeps ``slow`` seconds (so a test can signal it mid-run), having first
    added a line to ``started`` (one file per rank, in ``started_dir``)."""

    def __init__(self, batches_per_epoch: int, uneven: bool, slow: float, started_dir: Path) -> None:
        super().__init__(batches_per_epoch=batches_per_epoch)
        self.uneven = uneven
        self.slow = slow
        self.started_dir = started_dir

    def train_batches(self, epoch: int):
        rank = dist.get_rank() if dist.is_initialized() else 0
        n = self.batches_per_epoch - (2 if self.uneven and rank > 0 else 0)
        for i, batch in enumerate(super().train_batches(epoch)):
            if i < n:
                yield batch

    def step_loss(self, wrapped, batch):
        if self.slow and wrapped.training:
            rank = dist.get_rank() if dist.is_initialized() else 0
            with (self.started_dir / f"steps_started_rank{rank}").open("a") as f:
                f.write("step\n")
            time.sleep(self.slow)
        return super().step_loss(wrapped, batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, default=0, help="max_steps (0: one epoch)")
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    setup_logging()
    run_dir = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        UnevenTask(batches_per_epoch=6, uneven=args.uneven, slow=args.slow, started_dir=run_dir),
        TrainerConfig(
            run_dir=str(run_dir),
            max_steps=args.steps,
            epochs=1,
            log_every=1,
            checkpoint_every=0,
            progress=False,
            plots=False,
            seed=5,
            resume=args.resume,
        ),
        RankScheduleConfig(mode="threshold", threshold=0.999, truncate_every=4),
        OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2),
    )
    orig_close = trainer.close

    def close(destroy_group: bool = True) -> None:
        rank = trainer.process_rank
        torch.save(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, run_dir / f"params_rank{rank}.pt"
        )
        (run_dir / f"result_rank{rank}.json").write_text(
            json.dumps({"step": trainer.step, "epoch": trainer.epoch, "losses": trainer.losses})
        )
        orig_close(destroy_group)

    trainer.close = close  # type: ignore[method-assign]
    trainer.fit()


if __name__ == "__main__":
    main()
