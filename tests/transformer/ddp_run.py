"""Launched by torchrun from test_transformer.py: the tiny compressed classifier on 2
processes (gloo, DDP) with a truncation mid-run; each rank saves what the test compares."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from comera_rec.config import load_config
from comera_rec.transformer import runs

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    run_dir = Path(sys.argv[1])
    cfg = load_config(
        runs.ClassificationRun,
        str(ROOT / "configs/transformer_tiny.yaml"),
        [
            f"trainer.run_dir={run_dir}",
            "trainer.max_steps=8",
            "trainer.progress=false",
            "trainer.log_every=2",
            "schedule.mode=threshold",
            "schedule.threshold=0.999",
            "schedule.truncate_every=4",
            "data.synthetic_train=256",
            "data.synthetic_val=64",
        ],
    )
    original_close = runs.TransformerTrainer.close

    def close(self, *args, **kwargs) -> None:  # keep what the test compares before the group goes
        if dist.is_initialized():
            rank = dist.get_rank()
            torch.save(
                {k: v.detach().clone() for k, v in self.model.state_dict().items()}, run_dir / f"params_rank{rank}.pt"
            )
            (run_dir / f"record_rank{rank}.json").write_text(
                json.dumps({"losses": self.losses, "truncations": self.truncations, "world": dist.get_world_size()})
            )
        original_close(self, *args, **kwargs)

    runs.TransformerTrainer.close = close  # type: ignore[method-assign]
    runs.run_classification(cfg)


if __name__ == "__main__":
    main()
