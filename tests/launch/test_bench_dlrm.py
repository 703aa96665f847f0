"""The DLRM benchmark's own helpers (dlrm/bench.py, run by launch/bench_dlrm.py and comera-bench)."""

from __future__ import annotations

from dataclasses import replace

import torch

from comera_rec.dlrm import bench as bench_dlrm


def test_every_timed_step_gets_its_own_batch() -> None:
    # cycling a few batches lets a dense model fit them and slow down (denormal gradients)
    setup = replace(bench_dlrm.Setup(), batch_size=64)
    data = bench_dlrm.train_batches(setup, False, 5)
    assert len(data) == 5
    ids = [b.sparse_features.values() for b in data]
    assert all(len(v) == len(ids[0]) for v in ids)
    assert all(not torch.equal(ids[i], ids[j]) for i in range(5) for j in range(i + 1, 5))
    assert all(b.dense_features.shape == (64, 13) for b in data)
