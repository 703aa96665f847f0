"""Graceful stops and uneven data: SIGTERM / SIGINT end a run after the current step with a
checkpoint that ``--resume`` continues from, and processes that run out of batches at
different steps stop together instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from comera_rec.training import latest_checkpoint, load_checkpoint
from tests.reliability.helpers import ROOT, child_env, train_losses

WORKER = Path(__file__).parent / "toy_run.py"
STEPS = 16


def start(tmp_path: Path, run_dir: Path, args: list[str], nproc: int = 1) -> tuple[subprocess.Popen, Path]:
    """Start the toy worker (under torchrun when nproc > 1); its stderr goes to a file."""
    cmd = [sys.executable, str(WORKER)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER)]
    err = tmp_path / f"{run_dir.name}.stderr"
    proc = subprocess.Popen(
        cmd + [str(run_dir), *args],
        env=child_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=err.open("w"),
        start_new_session=True,
    )
    return proc, err


def finish(proc: subprocess.Popen, timeout: int = 120) -> int:
    """The exit code; a run still going after ``timeout`` s is a hang: killed, then failed."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the run hung (still running after {timeout} s)")


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def steps_logged(run_dir: Path) -> int:
    try:
        return len(train_losses(run_dir))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def steps_started(run_dir: Path) -> int:
    """How many training steps rank 0 has begun (the toy worker's marks under ``--slow``)."""
    try:
        return len((run_dir / "steps_started_rank0").read_text().splitlines())
    except FileNotFoundError:
        return 0


def run(tmp_path: Path, run_dir: Path, args: list[str], nproc: int = 1) -> str:
    proc, err = start(tmp_path, run_dir, args, nproc)
    code = finish(proc)
    assert code == 0, err.read_text()[-3000:]
    return err.read_text()


def interrupt(
    tmp_path: Path, run_dir: Path, sig: int, nproc: int = 1, after_steps: int = 3, args: Optional[list[str]] = None
) -> tuple[int, str]:
    """Start a slow run, send ``sig`` once ``after_steps`` steps are logged; (exit code, stderr)."""
    proc, err = start(tmp_path, run_dir, ["--steps", str(STEPS), "--slow", "0.3", *(args or [])], nproc)
    wait_for(lambda: steps_logged(run_dir) >= after_steps, f"{after_steps} steps", proc)
    proc.send_signal(sig)
    return finish(proc), err.read_text()


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy run without a stop (one launch for both signals' comparisons)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run(tmp, tmp / "ref", ["--steps", str(STEPS)])
    return tmp / "ref"


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_with_a_checkpoint_and_resume_matches(
    tmp_path: Path, uninterrupted: Path, sig: int, code: int
) -> None:
    ref, split = uninterrupted, tmp_path / "split"
    rc, stderr = interrupt(tmp_path, split, sig)
    assert rc == code, stderr[-3000:]
    done = max(train_losses(split))
    assert 3 <= done < STEPS
    name = signal.Signals(sig).name
    ckpt = latest_checkpoint(split / "checkpoints")
    assert f"{name} received: stopping after this step" in stderr
    assert f"stopped by {name} at step {done}; checkpoint {ckpt}; resume with --resume" in stderr
    assert ckpt.name == f"step_{done:09d}"  # checkpoint_every=0: the stop wrote it
    assert load_checkpoint(ckpt)[0]["trainer"]["step"] == done
    assert json.loads((split / "result_rank0.json").read_text())["step"] == done

    run(tmp_path, split, ["--steps", str(STEPS), "--resume"])
    assert train_losses(split) == train_losses(ref)  # every step, bit for bit
    assert_same_params(ref / "params_rank0.pt", split / "params_rank0.pt")


@pytest.mark.slow
def test_second_signal_aborts_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # signalled once the second step is under way: past the check that follows the first step
    # (a signal between the first step's log and that check stopped gracefully at once and the
    # checkpoint landed before the second signal). 8 s per step leave the second signal time
    proc, err = start(tmp_path, run_dir, ["--steps", str(STEPS), "--slow", "8"])
    wait_for(lambda: steps_started(run_dir) >= 2, "a second step", proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received" in err.read_text(), "notice of the first signal", proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == -signal.SIGTERM  # killed by the default handler, no checkpoint
    assert time.monotonic() - t0 < 2.5
    assert latest_checkpoint(run_dir / "checkpoints") is None


@pytest.mark.slow
def test_uneven_batches_across_ranks_stop_together(tmp_path: Path) -> None:
    """Rank 1 has 4 batches, rank 0 has 6 (epochs=1, max_steps=0): both stop after step 4."""
    run_dir = tmp_path / "run"
    stderr = run(tmp_path, run_dir, ["--uneven"], nproc=2)
    r0 = json.loads((run_dir / "result_rank0.json").read_text())
    r1 = json.loads((run_dir / "result_rank1.json").read_text())
    assert r0["step"] == r1["step"] == 4
    assert r0["losses"] == r1["losses"] and r0["epoch"] == r1["epoch"] == 1
    assert (
        "ranks ran out of batches unevenly at step 4: rank(s) 1 had none left; rank 0 leaves 2 batch(es) unused"
        in stderr
    )
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_000000004"
    assert "val_auc" in (run_dir / "summary.txt").read_text()


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_and_resume_matches(tmp_path: Path) -> None:
    """torchrun forwards SIGTERM to every worker: both stop at the same step with one checkpoint."""
    ref, split = tmp_path / "ref", tmp_path / "split"
    run(tmp_path, ref, ["--steps", str(STEPS)], nproc=2)
    _, stderr = interrupt(tmp_path, split, signal.SIGTERM, nproc=2)
    done = max(train_losses(split))
    assert 3 <= done < STEPS, stderr[-3000:]
    ckpt = latest_checkpoint(split / "checkpoints")
    assert f"stopped by SIGTERM at step {done}; checkpoint {ckpt}; resume with --resume" in stderr
    assert ckpt.name == f"step_{done:09d}" and (ckpt / "rank1.pt").exists()
    for rank in (0, 1):
        assert json.loads((split / f"result_rank{rank}.json").read_text())["step"] == done

    run(tmp_path, split, ["--steps", str(STEPS), "--resume"], nproc=2)
    assert train_losses(split) == train_losses(ref)
    for rank in (0, 1):
        assert_same_params(ref / f"params_rank{rank}.pt", split / f"params_rank{rank}.pt")
