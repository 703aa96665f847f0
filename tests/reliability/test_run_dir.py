"""One run per run_dir: a second launch fails on the lock, a fresh start never lands on
another run's checkpoints (refused, or moved aside with trainer.overwrite), pruning only
deletes the current run's checkpoints, and a resume keeps the run id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comera_rec.training.checkpoint import list_checkpoints, save_checkpoint
from comera_rec.training.rundir import LOCK_NAME, ExistingRunError, RunDirLockedError, check_fresh_start, lock_run_dir
from launch.train_dlrm import main
from tests.reliability.helpers import DEMO, ROOT, TINY, child_env
from tests.reliability.test_start_checks import assert_nothing_trained, toy_fit


def run_id(checkpoint: Path) -> str:
    return json.loads((checkpoint / "meta.json").read_text())["run_id"]


def test_second_launch_fails_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    lock = lock_run_dir(run)  # the first launch, still running
    try:
        with pytest.raises(RunDirLockedError, match=rf"{run}.*pid {os.getpid()} on host .*another trainer\.run_dir"):
            toy_fit(run)
        assert_nothing_trained(run)
    finally:
        lock.release()
    task, trainer = toy_fit(run)  # released: the run goes ahead, and releases it in its turn
    assert list_checkpoints(run / "checkpoints")
    lock_run_dir(run).release()


def test_lock_held_by_another_process_names_its_pid(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from comera_rec.training.rundir import lock_run_dir; "
            "lock_run_dir(Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)",
            str(run),
        ],
        env=child_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLockedError, match=rf"pid {holder.pid} on host"):
            lock_run_dir(run)
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: the OS did, the file left behind blocks nothing
    assert (run / LOCK_NAME).exists()
    lock_run_dir(run).release()


def test_fresh_run_into_a_folder_with_checkpoints_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    toy_fit(run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    with pytest.raises(ExistingRunError, match=r"--resume.*new trainer\.run_dir.*trainer\.overwrite=true"):
        toy_fit(run)
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_NAME}
    assert after == before  # the log and checkpoints untouched


def test_dlrm_fresh_run_into_a_used_folder_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["--config", DEMO, *TINY, "trainer.max_steps=2", f"trainer.run_dir={run}"]
    main(args)
    with pytest.raises(ExistingRunError, match=rf"{run}.*--resume"):
        main(args)
    main(args + ["trainer.overwrite=true"])
    assert len(list(tmp_path.glob("run.old-*/checkpoints/step_000000002"))) == 1


def test_overwrite_moves_the_old_run_aside(tmp_path: Path) -> None:
    run = tmp_path / "run"
    toy_fit(run)
    old_id = run_id(run / "checkpoints/step_000000002")
    old_log = (run / "log.jsonl").read_bytes()
    toy_fit(run, overwrite=True, max_steps=3)
    aside = list(tmp_path.glob("run.old-*"))
    assert len(aside) == 1
    assert run_id(aside[0] / "checkpoints/step_000000002") == old_id  # nothing deleted
    assert (aside[0] / "log.jsonl").read_bytes() == old_log
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000000003"]
    assert run_id(run / "checkpoints/step_000000003") != old_id


def test_pruning_never_deletes_another_runs_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    state = {"w": torch.ones(2)}
    for step in (5, 6):
        save_checkpoint(root, step, state, {}, keep=2, run_id="old")
    for step in (1, 2, 3):
        save_checkpoint(root, step, state, {}, keep=2, run_id="new")
    names = {p.name: run_id(p) for p in list_checkpoints(root)}
    # the new run keeps its newest two; the old run's higher steps neither count nor go
    assert names == {"step_000000002": "new", "step_000000003": "new", "step_000000005": "old", "step_000000006": "old"}
    save_checkpoint(root, 5, state, {}, keep=2, run_id="new")  # the same step: the old one is renamed aside
    assert run_id(root / "step_000000005") == "new"
    assert run_id(root / "step_000000005.run-old") == "old"
    assert run_id(root / "step_000000006") == "old"
    assert not (root / "step_000000002").exists()


def test_resume_keeps_the_run_id(tmp_path: Path) -> None:
    run = tmp_path / "run"
    toy_fit(run, keep_checkpoints=1)
    first = run_id(run / "checkpoints/step_000000002")
    toy_fit(run, resume=True, max_steps=4, keep_checkpoints=1)
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000000004"]  # pruned: same run
    assert run_id(run / "checkpoints/step_000000004") == first


def test_fresh_run_into_a_folder_with_another_runs_log_is_refused(tmp_path: Path) -> None:
    """A run without checkpoints still leaves its log.jsonl: a fresh start must not wipe it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text('{"kind": "train", "step": 1, "loss": 0.5}\n')
    with pytest.raises(ExistingRunError, match=r"another run's log.jsonl.*--resume.*trainer.overwrite=true"):
        check_fresh_start(run_dir, overwrite=False)
    assert (run_dir / "log.jsonl").read_text().startswith('{"kind": "train"')
    moved = check_fresh_start(run_dir, overwrite=True)
    assert moved is not None and (moved / "log.jsonl").exists() and not (run_dir / "log.jsonl").exists()
    (run_dir / "log.jsonl").write_text("")  # an empty log (a run that failed before its first record)
    assert check_fresh_start(run_dir, overwrite=False) is None
