"""Atomic checkpoints: a crash mid-write leaves the previous one loadable."""

from __future__ import annotations

import pickle

import pytest
import torch

from comera_rec.training import checkpoint as ckpt_mod
from comera_rec.training import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def state(v: float) -> dict:
    return {"model": {"w": torch.full((3,), v)}, "trainer": {"step": int(v)}, "name": "x", "t": (1, None)}


def test_save_load_and_keep_last(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        save_checkpoint(root, step, state(step), {"ranks": {"lin": [2, 2]}}, keep=2)
    assert [p.name for p in list_checkpoints(root)] == ["step_000000002", "step_000000003"]
    loaded, meta = load_checkpoint(latest_checkpoint(root))
    assert torch.equal(loaded["model"]["w"], torch.full((3,), 3.0)) and loaded["t"] == (1, None)
    assert meta["step"] == 3 and meta["ranks"] == {"lin": [2, 2]} and meta["complete"] is True


def test_crash_mid_write_keeps_previous(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 10, state(10), {})

    def crash(obj, f, *a, **kw):
        f.write(b"partial")
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(ckpt_mod.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 20, state(20), {})
    monkeypatch.undo()
    assert (root / ".tmp-step_000000020").exists()  # the partial write is left behind...
    # ...and so is a step folder without meta.json (e.g. copied by hand): both are ignored
    (root / "step_000000030").mkdir()
    (root / "step_000000030" / "rank0.pt").write_bytes(b"junk")
    assert latest_checkpoint(root).name == "step_000000010"
    loaded, _ = load_checkpoint(latest_checkpoint(root))
    assert loaded["trainer"]["step"] == 10
    save_checkpoint(root, 40, state(40), {})
    assert not (root / ".tmp-step_000000020").exists()  # stale temporaries are cleaned
    assert latest_checkpoint(root).name == "step_000000040"


class Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    root = tmp_path / "ckpt"
    path = save_checkpoint(root, 1, state(1), {})
    with open(path / "rank0.pt", "wb") as f:
        torch.save({"x": Evil()}, f)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)
