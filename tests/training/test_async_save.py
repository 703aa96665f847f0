"""Checkpoints written in a background thread (comera_rec.training.async_save): the same
files as a blocking save, a copy of the state taken at the call, errors raised on wait,
and the engine's background saves equal to its blocking ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_training_engine import run

from comera_rec.training import NonFiniteStateError, latest_checkpoint, list_checkpoints, load_checkpoint
from comera_rec.training.async_save import save_checkpoint_async
from comera_rec.training.checkpoint import checkpoint_problem, save_checkpoint


def _shared() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g)}}


def test_background_save_writes_what_a_blocking_save_writes(tmp_path: Path) -> None:
    state, shared = {"trainer": {"step": 5}, "rng": torch.arange(4)}, _shared()
    blocking = save_checkpoint(tmp_path / "a", 5, state, {"x": 1}, shared=shared)
    pending = save_checkpoint_async(tmp_path / "b", 5, state, {"x": 1}, shared=shared)
    assert pending.wait() == tmp_path / "b" / blocking.name and pending.done()
    assert checkpoint_problem(pending.path) is None and pending.stall_s >= 0 and pending.write_s > 0
    (sa, ma), (sb, mb) = load_checkpoint(blocking), load_checkpoint(pending.path)
    assert torch.equal(sa["model"]["w"], sb["model"]["w"]) and torch.equal(sa["rng"], sb["rng"])
    assert sa["trainer"] == sb["trainer"] and ma["x"] == mb["x"] == 1 and mb["step"] == 5


def test_background_save_holds_the_state_of_the_call(tmp_path: Path) -> None:
    """The training step changes the live tensors right after the call: the checkpoint must
    not see those changes."""
    shared, state = _shared(), {"trainer": {"step": 1}, "rng": torch.zeros(3)}
    want = shared["model"]["w"].clone()
    pending = save_checkpoint_async(tmp_path, 1, state, {}, shared=shared)
    shared["model"]["w"].add_(1.0)
    state["rng"].fill_(9.0)
    state["trainer"]["step"] = 99
    saved, _ = load_checkpoint(pending.wait())
    assert torch.equal(saved["model"]["w"], want) and torch.equal(saved["rng"], torch.zeros(3))
    assert saved["trainer"]["step"] == 1


def test_nonfinite_state_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    shared = _shared()
    shared["model"]["b"][3] = float("nan")
    with pytest.raises(NonFiniteStateError, match=r"model.*b"):
        save_checkpoint_async(tmp_path / "ckpt", 2, {"step": 2}, {}, shared=shared)
    assert not (tmp_path / "ckpt").exists()


def test_a_failed_background_write_is_raised_by_wait(tmp_path: Path) -> None:
    root = tmp_path / "not_a_folder"
    root.write_text("a file where the checkpoints should go")
    pending = save_checkpoint_async(root, 3, {"step": 3}, {}, shared=_shared())
    with pytest.raises(OSError):
        pending.wait()


def test_engine_background_checkpoints_equal_blocking_ones(tmp_path: Path) -> None:
    """Periodic checkpoints in the background (rank cuts in between change shapes) give the
    same losses and the same checkpoint files' contents as blocking saves."""
    blocking = run(tmp_path / "blocking", 12, checkpoint_every=4)
    background = run(tmp_path / "background", 12, checkpoint_every=4, async_checkpoint=True)
    assert background.losses == blocking.losses and background._pending is None
    names = [p.name for p in list_checkpoints(tmp_path / "background" / "checkpoints")]
    assert (
        names
        == [p.name for p in list_checkpoints(tmp_path / "blocking" / "checkpoints")]
        == [
            "step_000000008",
            "step_000000012",
        ]
    )
    for name in names:
        a, _ = load_checkpoint(tmp_path / "blocking" / "checkpoints" / name)
        b, _ = load_checkpoint(tmp_path / "background" / "checkpoints" / name)
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), name
    # and a run resumes from a background checkpoint as from a blocking one
    resumed = run(tmp_path / "background", 16, resume=True, checkpoint_every=4, async_checkpoint=True)
    assert latest_checkpoint(tmp_path / "background" / "checkpoints").name == "step_000000016"
    assert resumed.step == 16


def test_staging_buffers_are_refilled_and_remade_when_shapes_change() -> None:
    from comera_rec.training.async_save import Staging, snapshot

    staging, flat = Staging(), {"w": torch.ones(5, 3), "b": torch.zeros(3)}
    first = snapshot(flat, staging)
    flat["w"].add_(1.0)
    second = snapshot(flat, staging)
    assert second["w"].data_ptr() == first["w"].data_ptr() != flat["w"].data_ptr()  # refilled, not shared
    assert torch.equal(second["w"], torch.full((5, 3), 2.0))
    flat["w"] = torch.ones(4, 3)  # a rank cut: another shape
    third = snapshot(flat, staging)
    assert third["w"].shape == (4, 3) and third["w"].data_ptr() != first["w"].data_ptr()


def test_nonfinite_check_finds_what_a_sum_hides_and_accepts_an_overflowing_sum() -> None:
    from comera_rec.training.checkpoint import nonfinite_entries

    big = torch.full((4,), 3e38)  # finite entries whose float32 sum overflows to inf
    assert nonfinite_entries({"big": big}) == []
    bad = torch.tensor([float("inf"), float("-inf"), 1.0])  # a NaN sum, from two infs
    assert nonfinite_entries({"a": {"bad": bad}, "ok": torch.ones(2)}) == ["a.bad"]
