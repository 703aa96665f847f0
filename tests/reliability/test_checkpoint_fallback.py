"""A damaged newest checkpoint (changed bytes, unreadable, incomplete) is skipped with a
warning naming it and why, and the newest good one is resumed from; every load logs the
step and folder it read."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from comera_rec.rank import RankScheduleConfig
from comera_rec.training import (
    CheckpointError,
    OptimConfig,
    Trainer,
    TrainerConfig,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from comera_rec.training import checkpoint as ckpt_mod

LOGGER = "comera_rec.training.checkpoint"


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "trainer": {"step": int(v)}}


def _flip_bytes(file: Path) -> None:
    """Change bytes in the middle of ``file``, keeping its size (the size check passes)."""
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    file.write_bytes(bytes(data))


def _three(root: Path) -> list[Path]:
    return [save_checkpoint(root, step, _state(step), {}, keep=0) for step in (1, 2, 3)]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def test_flipped_bytes_in_newest_fall_back_to_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    first, second, third = _three(root)
    _flip_bytes(third / "rank0.pt")
    # the size is right: only the checksum tells it is damaged
    assert [p.name for p in list_checkpoints(root)] == [first.name, second.name, third.name]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert latest_checkpoint(root) == second
        state, meta = load_checkpoint(second)
    assert state["trainer"]["step"] == 2 and meta["step"] == 2
    warned = _warnings(caplog)
    assert any(str(third) in w and "SHA-256 of rank0.pt" in w for w in warned), warned
    assert any("falling back to checkpoint" in w and str(second) in w for w in warned), warned
    loaded = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert any("step 2" in m and str(second) in m for m in loaded), loaded
    # asked for by name, the damaged one is still a clear error
    with pytest.raises(CheckpointError, match="rank0.pt: damaged"):
        load_checkpoint(third)


def test_unreadable_and_incomplete_newest_are_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    first, second, third = _three(root)
    real = ckpt_mod.file_sha256

    def unreadable(path: Path) -> str:
        if path.parent == third:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(ckpt_mod, "file_sha256", unreadable)
    meta = json.loads((second / "meta.json").read_text())
    meta.pop("complete")
    (second / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert latest_checkpoint(root) == first
    warned = _warnings(caplog)
    assert any(str(third) in w and "unreadable" in w and "Permission denied" in w for w in warned), warned
    assert any(str(second) in w and "incomplete" in w and '"complete": true' in w for w in warned), warned


def test_all_damaged_gives_none_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    paths = _three(root)
    for p in paths:
        _flip_bytes(p / "rank0.pt")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert latest_checkpoint(root) is None  # as for no (complete) checkpoint: a fresh start
    warned = _warnings(caplog)
    for p in paths:
        assert any(str(p) in w for w in warned), (p, warned)
    assert any("no usable checkpoint" in w and "all 3" in w for w in warned), warned
    assert latest_checkpoint(tmp_path / "absent") is None


def test_checkpoint_without_recorded_checksum_is_accepted_on_its_size(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ckpt", 1, _state(1), {})
    meta = json.loads((path / "meta.json").read_text())
    meta.pop("sha256")  # written before checksums were recorded
    (path / "meta.json").write_text(json.dumps(meta))
    assert latest_checkpoint(tmp_path / "ckpt") == path
    assert load_checkpoint(path)[0]["trainer"]["step"] == 1


def test_saves_after_a_fallback_keep_the_new_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for step in (10, 20, 30):
        save_checkpoint(root, step, _state(step), {}, keep=0)
    _flip_bytes(root / "step_000000030" / "rank0.pt")
    assert latest_checkpoint(root).name == "step_000000020"
    # the resumed run saves step 25 with keep=1: the newer damaged folder must not count,
    # or the checkpoint just written would be pruned at once
    save_checkpoint(root, 25, _state(25), {}, keep=1)
    assert [p.name for p in list_checkpoints(root)] == ["step_000000025", "step_000000030"]
    assert latest_checkpoint(root).name == "step_000000025"
    save_checkpoint(root, 30, _state(30), {}, keep=1)  # replaces the damaged one
    assert [p.name for p in list_checkpoints(root)] == ["step_000000030"]
    assert load_checkpoint(latest_checkpoint(root))[0]["trainer"]["step"] == 30


# ---------------------------------------------------------------------------- through the engine


def _toy_run(run_dir: Path, steps: int, resume: bool = False) -> Trainer:
    from tests.training.toy_task import ToyTask

    config = TrainerConfig(
        run_dir=str(run_dir),
        max_steps=steps,
        log_every=1,
        eval_every=0,
        checkpoint_every=2,
        keep_checkpoints=0,
        progress=False,
        plots=False,
        resume=resume,
        seed=1,
    )
    schedule = RankScheduleConfig(mode="threshold", threshold=0.999, truncate_every=3, late_stage=False)
    trainer = Trainer(
        ToyTask(batches_per_epoch=5), config, schedule, OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2)
    )
    trainer.fit()
    return trainer


def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    full = _toy_run(tmp_path / "full", 6)
    run = tmp_path / "split"
    _toy_run(run, 4)
    root = run / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_000000002", "step_000000004"]
    _flip_bytes(root / "step_000000004" / "rank0.pt")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        resumed = _toy_run(run, 6, resume=True)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("skipping checkpoint" in m and "step_000000004" in m and "SHA-256" in m for m in messages), messages
    assert any("loaded checkpoint of step 2" in m and "step_000000002" in m for m in messages), messages
    # steps 3 and 4 are computed again, from the same state: the same losses as one run
    assert resumed.losses == full.losses[2:]
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert latest_checkpoint(root).name == "step_000000006"
    assert load_checkpoint(root / "step_000000004")[0]["trainer"]["step"] == 4  # saved again, sound
