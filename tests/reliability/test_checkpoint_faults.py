"""Interrupted and damaged checkpoints: the previous one stays loadable, a partial one is
never picked up, and loading never runs pickled code."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from comera_rec.training import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from launch.train_dlrm import main
from tests.reliability.helpers import DEMO, TINY, run_train, train_losses

COMMON = TINY + ["trainer.max_steps=6", "trainer.checkpoint_every=3", "trainer.eval_every=0"]


def test_kill_during_checkpoint_write_keeps_previous_and_resume_matches(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # SIGKILL after rank0.pt of step 6 is written, before its meta.json and rename
    proc = run_train(tmp_path, COMMON + [f"trainer.run_dir={run}"], COMERA_FAULT_KILL_IN_CHECKPOINT="6")
    assert proc.returncode == -9, proc.stderr[-3000:]
    root = run / "checkpoints"
    partial = root / ".tmp-step_000000006"
    assert (partial / "rank0.pt").is_file() and not (partial / "meta.json").exists()
    assert [p.name for p in list_checkpoints(root)] == ["step_000000003"]
    state, meta = load_checkpoint(latest_checkpoint(root))
    assert meta["step"] == 3 and state["trainer"]["step"] == 3

    # one thread here too, as in the killed subprocess (OMP_NUM_THREADS=1): MKL's GEMMs add
    # in a thread-count-dependent order, and bit-equality is asked of the parameters
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main(["--config", DEMO, "--resume", *COMMON, f"trainer.run_dir={run}"])
        assert not partial.exists()  # the next save removed the stale temporary
        assert latest_checkpoint(root).name == "step_000000006"
        whole = tmp_path / "whole"
        main(["--config", DEMO, *COMMON, f"trainer.run_dir={whole}"])
    finally:
        torch.set_num_threads(threads)
    assert train_losses(run) == train_losses(whole)
    a = load_checkpoint(latest_checkpoint(root))[0]["model"]
    b = load_checkpoint(latest_checkpoint(whole / "checkpoints"))[0]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_kill_during_a_background_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    """trainer.async_checkpoint: the process dies while the background thread writes step 6;
    step 3 (also written in the background) stays complete and loadable."""
    run = tmp_path / "run"
    args = COMMON + [f"trainer.run_dir={run}", "trainer.async_checkpoint=true"]
    proc = run_train(tmp_path, args, COMERA_FAULT_KILL_IN_CHECKPOINT="6")
    assert proc.returncode == -9, proc.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / ".tmp-step_000000006" / "rank0.pt").is_file()
    assert not (root / ".tmp-step_000000006" / "meta.json").exists()
    assert [p.name for p in list_checkpoints(root)] == ["step_000000003"]
    state, meta = load_checkpoint(latest_checkpoint(root))
    assert meta["step"] == 3 and state["trainer"]["step"] == 3


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((64,), v)}, "trainer": {"step": int(v)}}


def test_damaged_checkpoints_are_never_picked(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, _state(1), {}, keep=0)
    good = save_checkpoint(root, 2, _state(2), {}, keep=0)
    # a truncated rank file (size differs from meta.json)
    cut = save_checkpoint(root, 3, _state(3), {}, keep=0)
    data = (cut / "rank0.pt").read_bytes()
    (cut / "rank0.pt").write_bytes(data[: len(data) // 2])
    # a missing rank file, a garbage meta.json, a meta.json without "complete", junk temp dirs
    for step, fix in ((4, "missing"), (5, "garbage"), (6, "incomplete")):
        p = save_checkpoint(root, step, _state(step), {}, keep=0)
        if fix == "missing":
            (p / "rank0.pt").unlink()
        elif fix == "garbage":
            (p / "meta.json").write_text("{not json")
        else:
            meta = json.loads((p / "meta.json").read_text())
            meta.pop("complete")
            (p / "meta.json").write_text(json.dumps(meta))
    (root / ".tmp-step_000000007").mkdir()
    (root / ".tmp-step_000000007" / "rank0.pt.part").write_bytes(b"\x00" * 10)
    (root / "step_000000008.part").mkdir()
    assert latest_checkpoint(root) == good
    state, _ = load_checkpoint(good)
    assert state["trainer"]["step"] == 2
    # corrupt bytes of the right size inside a complete checkpoint: a clear error, not a crash
    data = bytearray((good / "rank0.pt").read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = b"\xff" * 64
    (good / "rank0.pt").write_bytes(bytes(data))
    with pytest.raises((CheckpointError, pickle.UnpicklingError), match="rank0.pt|Weights only load failed"):
        load_checkpoint(good)
    with pytest.raises(CheckpointError, match="rank0.pt: cannot be read"):
        load_checkpoint(cut)  # asked for by name, the cut file is still refused


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path: Path, marker: Path) -> None:
    """Replace rank0.pt by a pickle with a payload, keeping meta.json consistent with it."""
    with open(path / "rank0.pt", "wb") as f:
        torch.save({"model": {"w": torch.zeros(2)}, "evil": _Payload(marker)}, f)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = {"rank0.pt": (path / "rank0.pt").stat().st_size}
    meta.pop("sha256")  # an attacker who can write rank0.pt can rewrite meta.json as well
    (path / "meta.json").write_text(json.dumps(meta))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    path = save_checkpoint(tmp_path / "ckpt", 1, _state(1), {})
    _plant(path, marker)
    assert latest_checkpoint(tmp_path / "ckpt") == path  # looks complete...
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)
    assert not marker.exists()  # ...but the payload never ran

    # the same through the trainer's resume
    run = tmp_path / "run"
    args = ["--config", DEMO, *TINY, "trainer.max_steps=1", "trainer.eval_every=0", f"trainer.run_dir={run}"]
    main(args)
    _plant(latest_checkpoint(run / "checkpoints"), marker)
    with pytest.raises(pickle.UnpicklingError):
        main(args[:2] + ["--resume"] + args[2:])
    assert not marker.exists()
