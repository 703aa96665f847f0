"""Elastic restarts: a worker SIGKILLed mid-run under torchrun --max-restarts resumes from the
last checkpoint and ends exactly where an uninterrupted run with the same seed ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from comera_rec.training import latest_checkpoint, load_checkpoint
from tests.reliability.helpers import TINY, run_train, train_losses

# threshold 2 > every controller: step 4 truncates (the restart replays a truncation)
COMMON = TINY + [
    "trainer.max_steps=8",
    "trainer.checkpoint_every=3",
    "schedule.mode=threshold",
    "schedule.truncate_every=4",
    "schedule.threshold=2.0",
]


@pytest.mark.slow
def test_killed_worker_restarts_and_matches_uninterrupted_run(tmp_path: Path) -> None:
    ref, elastic = tmp_path / "ref", tmp_path / "elastic"
    proc = run_train(tmp_path, COMMON + [f"trainer.run_dir={ref}"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 1 kills itself (SIGKILL) after step 5; the checkpoint of step 3 is the newest
    proc = run_train(
        tmp_path,
        COMMON + [f"trainer.run_dir={elastic}"],
        nproc=2,
        max_restarts=1,
        COMERA_FAULT_KILL_AT_STEP="5",
        COMERA_FAULT_KILL_RANK="1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: -9" in proc.stderr  # the kill really happened...
    assert "torchrun restart 1: resuming from" in proc.stderr and "step_000000003" in proc.stderr  # ...and the resume
    assert (elastic / ".fault-comera_fault_kill_at_step-5-rank1").exists()

    a, b = train_losses(ref), train_losses(elastic)
    assert sorted(b) == list(range(1, 9))
    assert a == b  # bit for bit, including the steps replayed after the restart
    sa = json.loads((ref / "summary.json").read_text())
    sb = json.loads((elastic / "summary.json").read_text())
    for key in (
        "steps",
        "samples",
        "final_train_loss",
        "val_auc",
        "val_accuracy",
        "val_log_loss",
        "live_rank",
        "tt_bytes",
        "model_bytes",
        "truncations",
        "nonfinite_skipped",
    ):
        assert sa[key] == sb[key], key
    ca, cb = latest_checkpoint(ref / "checkpoints"), latest_checkpoint(elastic / "checkpoints")
    assert ca.name == cb.name == "step_000000008"
    for rank in (0, 1):
        pa, pb = load_checkpoint(ca, rank=rank)[0]["model"], load_checkpoint(cb, rank=rank)[0]["model"]
        assert pa.keys() == pb.keys()
        for k in pa:
            assert_same(pa[k], pb[k], (rank, k))


def assert_same(a, b, where) -> None:
    """Bit-for-bit equality of checkpoint entries: tensors, or the dicts and lists a sharded
    table's local shards are saved as."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], (*where, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, (*where, i))
    else:
        assert a == b, where
