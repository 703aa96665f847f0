"""The engine on the toy task: a full run, resume equivalence, non-finite losses, 2-process DDP."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch
from toy_task import ToyTask

import comera_rec.training.step as step_module
from comera_rec.rank import RankScheduleConfig
from comera_rec.training import OptimConfig, Trainer, TrainerConfig, latest_checkpoint, load_checkpoint, read_jsonl

HERE = Path(__file__).parent


def optim() -> OptimConfig:
    return OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2)


def schedule(**kw) -> RankScheduleConfig:
    # threshold just below the initial controller value 1: every step some entries fall
    # under it, so truncation really happens within a few steps
    base = dict(mode="threshold", threshold=0.999, truncate_every=3, late_stage=True, switch="step", switch_step=5)
    base.update(kw)
    return RankScheduleConfig(**base)


def run(run_dir: Path, steps: int, resume: bool = False, sched: dict | None = None, **trainer_kw) -> Trainer:
    kw = dict(
        run_dir=str(run_dir),
        max_steps=steps,
        log_every=1,
        eval_every=4,
        checkpoint_every=4,
        progress=False,
        plots=False,
        resume=resume,
        seed=1,
    )
    kw.update(trainer_kw)
    trainer = Trainer(ToyTask(batches_per_epoch=5), TrainerConfig(**kw), schedule(**(sched or {})), optim())
    trainer.fit()
    return trainer


def test_full_run_learns_and_reports(tmp_path):
    t = run(tmp_path, 40, plots=True, eval_every=10, checkpoint_every=20, progress=True)
    records = read_jsonl(tmp_path / "log.jsonl")
    kinds = {r["kind"] for r in records}
    assert kinds == {"train", "eval", "truncate", "summary"}
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20, 30, 40]
    assert evals[-1]["auc"] > 0.6  # the toy rule is learnable
    trains = [r for r in records if r["kind"] == "train"]
    assert trains[-1]["stage"] == "late" and trains[0]["stage"] == "early"
    assert trains[-1]["live_rank"] < trains[0]["live_rank"]
    assert trains[-1]["compression"] > trains[0]["compression"]
    assert all(r["samples_per_s"] > 0 and r["peak_mem_mb"] > 0 for r in trains)
    assert t.truncations > 0
    for name in ("loss_auc.png", "ranks_compression.png", "summary.txt", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["val_auc"] == evals[-1]["auc"]
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_000000040"
    assert gc.get_freeze_count() == 0  # trainer.freeze_gc froze the set-up; close() released it


def test_bfloat16_autocast_run_learns(tmp_path, monkeypatch):
    # the forward under autocast (the toy's dense head in bfloat16, its TT layer and lookup in
    # float32), the backward outside it: the run trains and validates as in float32 (on any
    # host: one without bfloat16 kernels is refused, the next test)
    monkeypatch.setattr(step_module, "cpu_bfloat16_products", lambda: True)
    t = run(tmp_path, 40, eval_every=20, checkpoint_every=0, autocast="bfloat16")
    evals = [r for r in read_jsonl(tmp_path / "log.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[-1]["auc"] > 0.6
    assert all(p.dtype == torch.float32 for p in t.model.parameters())


def test_bfloat16_autocast_is_refused_before_the_run_starts_on_a_cpu_without_bfloat16_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(step_module, "cpu_bfloat16_products", lambda: False)
    with pytest.raises(ValueError, match=r"trainer.autocast='bfloat16'.*reference loop.*trainer.autocast=none"):
        run(tmp_path / "run", 3, autocast="bfloat16")
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_freeze_gc_freezes_during_the_loop(tmp_path, monkeypatch):
    import comera_rec.training.engine as engine

    counts = []
    real = engine.freeze_live_objects
    monkeypatch.setattr(engine, "freeze_live_objects", lambda: counts.append(real()) or counts[-1])
    run(tmp_path / "on", 3)
    assert len(counts) == 1 and counts[0] > 0
    run(tmp_path / "off", 3, freeze_gc=False)
    assert len(counts) == 1


def test_resume_gives_the_same_losses(tmp_path):
    sched = dict(truncate_every=2, switch_step=3)
    full = run(tmp_path / "full", 11, sched=sched)
    # 5 steps: truncations at 2 and 4, the late stage from 3, the checkpoint at the end of
    # epoch 0; the resumed part starts epoch 1 and truncates again at 6 (ranks fall)
    first = run(tmp_path / "split", 5, sched=sched)
    assert first.truncations == 2 and first.schedule.stage == "late"
    ranks_at_5 = first.model.lin.ranks + first.model.emb.ranks
    second = run(tmp_path / "split", 11, resume=True, sched=sched)
    assert first.losses == full.losses[:5]
    assert second.losses == full.losses[5:]
    assert second.truncations == full.truncations > 2
    assert second.model.lin.ranks + second.model.emb.ranks != ranks_at_5
    for (k, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), k
    # the log of the resumed run is continuous: one train record per step
    steps = [r["step"] for r in read_jsonl(tmp_path / "split" / "log.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 12))


def test_budget_resume_cuts_as_the_uninterrupted_run(tmp_path):
    """The budget schedule's plan and slice costs survive a resume: a run resumed from its
    step-7 checkpoint (costs gathered since the cut at 5) cuts at 9, 13 and 16 exactly as
    the uninterrupted run, and ends in the same state."""
    sched = dict(mode="budget", threshold=1e-2, target_size_ratio=0.3, prune_end=0.8, num_cuts=4)
    full = run(tmp_path / "full", 20, sched=sched, checkpoint_every=7, keep_checkpoints=0)
    assert full.schedule.cut_steps() == [5, 9, 13, 16] and full.truncations >= 3
    saved, _ = load_checkpoint(tmp_path / "full" / "checkpoints" / "step_000000007")
    assert saved["schedule"]["slice_cost_steps"] == 2  # steps 6 and 7, since the cut at 5
    assert saved["schedule"]["slice_costs"] and saved["schedule"]["size_at_start"] > 0
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "full", split)
    for later in ("step_000000014", "step_000000020"):
        shutil.rmtree(split / "checkpoints" / later)
    second = run(split, 20, resume=True, sched=sched, checkpoint_every=7, keep_checkpoints=0)
    assert second.losses == full.losses[7:]
    assert second.model.lin.ranks + second.model.emb.ranks == full.model.lin.ranks + full.model.emb.ranks
    for (k, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_nonfinite_batches_are_skipped(tmp_path):
    trainer = Trainer(
        ToyTask(batches_per_epoch=5, nan_batches=(1, 3)),
        TrainerConfig(run_dir=str(tmp_path), max_steps=6, progress=False, plots=False, checkpoint_at_end=False),
        schedule(),
        optim(),
    )
    summary = trainer.fit()
    assert summary["nonfinite_skipped"] == 2 and summary["steps"] == 6
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    strict = Trainer(
        ToyTask(batches_per_epoch=5, nan_batches=(1,)),
        TrainerConfig(run_dir=str(tmp_path / "s"), max_steps=6, progress=False, plots=False, skip_nonfinite=False),
        schedule(),
        optim(),
    )
    with pytest.raises(FloatingPointError, match="non-finite loss at step 2"):
        strict.fit()


@pytest.mark.slow
def test_two_process_ddp_run(tmp_path):
    from tests.reliability.helpers import run_torchrun

    run_dir = tmp_path / "run"
    proc = run_torchrun(HERE / "ddp_run.py", [str(run_dir)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    p0 = torch.load(run_dir / "params_rank0.pt", weights_only=True)
    p1 = torch.load(run_dir / "params_rank1.pt", weights_only=True)
    assert p0.keys() == p1.keys()
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    r0 = json.loads((run_dir / "ranks_rank0.json").read_text())
    r1 = json.loads((run_dir / "ranks_rank1.json").read_text())
    assert r0 == r1  # the same global losses, skips and truncations on both
    assert r0["truncations"] >= 1 and r0["nonfinite"] == 1
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt.name == "step_000000010" and (ckpt / "rank1.pt").exists()
    assert "val_auc" in (run_dir / "summary.txt").read_text()
