"""The DLRM trainer end to end: one and two processes, resume, config errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import comera_rec.training.step as step_module
from comera_rec.config import ConfigError
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.task import load_run_config
from launch.train_dlrm import main
from tests.dlrm.tiny import TINY

ROOT = Path(__file__).resolve().parents[2]


def read_log(run_dir: Path) -> list[dict]:
    with open(run_dir / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(run_dir) if r["kind"] == "train"}


def copy_up_to(run_dir: Path, copy: Path, step: int) -> None:
    """``run_dir`` as it stood after ``step``: its checkpoints up to ``step`` and its log up to
    ``step``, so that a resume of the copy must train and log the later steps itself."""
    shutil.copytree(run_dir, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    kept = [r for r in read_log(run_dir) if r.get("step", step + 1) <= step]  # not the run's summary
    (copy / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


def test_resume_continues_the_same_run_across_a_truncation(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    # threshold 2 > every controller: step 4 cuts every bond to rank 1 (a real truncation)
    common = TINY + [
        "schedule.mode=threshold",
        "schedule.threshold=2.0",
        "schedule.truncate_every=4",
        "trainer.plots=false",
        "trainer.checkpoint_every=6",
    ]
    whole, part = tmp_path / "whole", tmp_path / "part"
    summary = main(
        ["--config", str(ROOT / "configs/dlrm_demo.yaml"), *common, "trainer.max_steps=12", f"trainer.run_dir={whole}"]
    )
    assert summary["truncations"] >= 1
    # the uninterrupted run's own step-6 checkpoint, in a copy, is what the resume starts from
    copy_up_to(whole, part, 6)
    capfd.readouterr()
    main(
        [
            "--config",
            str(ROOT / "configs/dlrm_demo.yaml"),
            "--resume",
            *common,
            "trainer.max_steps=12",
            f"trainer.run_dir={part}",
        ]
    )
    # the reader seeks to the saved row position (no batch is re-read) ...
    assert "resuming the data of epoch 0 at the saved row position" in capfd.readouterr().err
    # ... and the run goes on exactly as the uninterrupted one
    a, b = train_losses(whole), train_losses(part)
    assert sorted(b) == list(range(1, 13))
    for step in range(7, 13):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step


@pytest.mark.parametrize("config", ["dlrm_demo.yaml", "dlrm_demo_dense.yaml"])
def test_bfloat16_autocast_trains_the_compressed_and_the_dense_model(tmp_path: Path, config: str, monkeypatch) -> None:
    # trainer.autocast from the command line: the forward in bfloat16 where autocast picks it
    # (the fused CPU kernels stay float32), the backward outside; the loss falls, AUC is read
    # (on any host: the check that refuses it on a CPU without bfloat16 kernels passes here)
    monkeypatch.setattr(step_module, "cpu_bfloat16_products", lambda: True)
    summary = main(
        [
            "--config",
            str(ROOT / "configs" / config),
            *TINY,
            "trainer.autocast=bfloat16",
            "trainer.max_steps=30",
            "trainer.plots=false",
            "trainer.checkpoint_at_end=false",
            f"trainer.run_dir={tmp_path}",
        ]
    )
    losses = train_losses(tmp_path)
    assert sorted(losses) == list(range(1, 31))
    assert sum(losses[s] for s in range(26, 31)) < sum(losses[s] for s in range(1, 6))
    assert 0.5 < summary["val_auc"] <= 1.0 and summary["nonfinite_skipped"] == 0


def test_unknown_config_key_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'model.rnk'.*valid keys of model: .*rank"):
        load_run_config(str(ROOT / "configs/dlrm_demo.yaml"), ["model.rnk=3"])


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("dlrm_*.yaml")))
def test_every_config_file_loads(name: str) -> None:
    cfg = load_run_config(str(ROOT / "configs" / name))
    assert cfg.model.bottom_mlp[-1] == cfg.model.embedding_dim
    assert cfg.model.compressed == (not name.endswith("_dense.yaml"))
    if name == "dlrm_criteo_kaggle.yaml":  # the file and DLRMConfig.kaggle() build one model
        assert (
            cfg.model.policy() == DLRMConfig.kaggle(**{k: getattr(cfg.model, k) for k in ("rank", "mlp_rank")}).policy()
        )


@pytest.mark.slow
def test_two_process_demo_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "launch/train_dlrm.py"),
            "--config",
            str(ROOT / "configs/dlrm_demo.yaml"),
            *TINY,
            "trainer.max_steps=60",
            "trainer.eval_every=30",
            "schedule.truncate_every=20",
            f"trainer.run_dir={run_dir}",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr  # clean gloo shutdown
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 60
    assert summary["val_auc"] > 0.6  # the synthetic task has real signal (Bayes AUC ~0.82)
    for png in ("loss_auc.png", "ranks_compression.png"):
        assert (run_dir / png).stat().st_size > 1000
    evals = [r for r in read_log(run_dir) if r["kind"] == "eval"]
    assert [r["step"] for r in evals][-1] == 60


@pytest.mark.slow
def test_two_process_resume_with_sharded_tables(tmp_path: Path) -> None:
    """Table-wise sharded dense tables: each process stores its local shards as plain
    tensors (weights-only loadable) and gets them back after re-sharding."""
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    common = [
        *TINY,
        "embedding_optim.sharding_type=table_wise",
        "trainer.checkpoint_every=3",
        "schedule.mode=threshold",
        "schedule.threshold=2.0",
        "schedule.truncate_every=4",
        "trainer.plots=false",
    ]

    def run(run_dir: Path, steps: int, *extra: str) -> None:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(ROOT / "launch/train_dlrm.py"),
                "--config",
                str(ROOT / "configs/dlrm_demo.yaml"),
                *common,
                f"trainer.max_steps={steps}",
                f"trainer.run_dir={run_dir}",
                *extra,
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    whole, part = tmp_path / "whole", tmp_path / "part"
    run(whole, 9)
    # a copy of the run at its step-6 checkpoint resumes (one launch fewer than a run to 6)
    copy_up_to(whole, part, 6)
    run(part, 9, "--resume")
    a, b = train_losses(whole), train_losses(part)
    for step in range(7, 10):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
