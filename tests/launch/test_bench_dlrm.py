"""The DLRM benchmark's own helpers (launch/bench_dlrm.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
import bench_dlrm  # noqa: E402


def test_every_timed_step_gets_its_own_batch() -> None:
    # cycling a few batches lets a dense model fit them and slow down (denormal gradients)
    setup = replace(bench_dlrm.Setup(), batch_size=64)
    data = bench_dlrm.train_batches(setup, False, 5)
    assert len(data) == 5
    ids = [b.sparse_features.values() for b in data]
    assert all(len(v) == len(ids[0]) for v in ids)
    assert all(not torch.equal(ids[i], ids[j]) for i in range(5) for j in range(i + 1, 5))
    assert all(b.dense_features.shape == (64, 13) for b in data)
