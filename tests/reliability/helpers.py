"""Shared pieces of the reliability tests: the tiny DLRM run and subprocess launchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from tests.dlrm.tiny import TABLE_SIZES  # noqa: F401 (TABLE_SIZES re-exported)
from tests.dlrm.tiny import TINY as BASE_TINY

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "configs/dlrm_demo.yaml")
TRAIN = str(ROOT / "launch/train_dlrm.py")

# The trainer tests' tiny run, without plots and with a short validation.
TINY = BASE_TINY + ["trainer.plots=false", "trainer.eval_max_batches=2"]


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment of a training subprocess: the repo importable, torchrun's files in tmp_path."""
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_torchrun(
    script: Path, args: list[str], tmp_path: Path, nproc: int = 2, timeout: int = 240
) -> subprocess.CompletedProcess:
    """Run a test worker script under ``torchrun --standalone`` with :func:`child_env`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]
    return subprocess.run(cmd, env=child_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run_train(
    tmp_path: Path, args: list[str], nproc: int = 1, max_restarts: Optional[int] = None, timeout: int = 240, **env: str
) -> subprocess.CompletedProcess:
    """Run launch/train_dlrm.py in a subprocess (under torchrun when nproc > 1 or restarts are asked)."""
    if nproc > 1 or max_restarts is not None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if max_restarts is not None:
            cmd.append(f"--max-restarts={max_restarts}")
        cmd.append(TRAIN)
    else:
        cmd = [sys.executable, TRAIN]
    return subprocess.run(
        cmd + ["--config", DEMO, *args],
        env=child_env(tmp_path, **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_losses(run_dir: Path) -> dict[int, float]:
    """Global train loss per step from a run's log.jsonl."""
    with open(run_dir / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
