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


def test_isa_avx2_runs_the_command_again_under_the_switches(monkeypatch) -> None:
    from comera_rec.utils.isa import isa_environment

    for name in isa_environment("avx2"):
        monkeypatch.delenv(name, raising=False)
    calls = []

    def fake_execve(path, args, env):
        calls.append((path, args, env))
        raise SystemExit(0)  # execve does not return

    monkeypatch.setattr(bench_dlrm.os, "execve", fake_execve)
    try:
        bench_dlrm.main(["--quick", "--isa", "avx2"])
    except SystemExit:
        pass
    ((path, args, env),) = calls
    assert path == bench_dlrm.sys.executable
    assert args[1] == "-c" and "bench import main; main()" in args[2] and args[3:] == ["--quick", "--isa", "avx2"]
    assert all(env[k] == v for k, v in isa_environment("avx2").items())


def test_isa_is_checked_before_anything_runs(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        bench_dlrm.main(["--isa", "avx10"])
    assert "invalid choice: 'avx10'" in capsys.readouterr().err
