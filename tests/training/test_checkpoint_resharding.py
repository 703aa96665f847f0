"""Resume across world sizes and sharding plans (checkpoints on torch.distributed.checkpoint).

Each test resumes the tiny DLRM's step-4 checkpoint with another number of processes or
another table sharding, with ``max_steps=4``: the run loads, validates and writes step 4
again, now with its own world size and plan. Globally (every table gathered whole, read in
this one process) that checkpoint must equal the one it loaded, the row-wise Adagrad
accumulators converted where the column shards changed. The four-process and column-wise
resumes train on to step 6 in the same launch, writing step 4 again before their first step.
Bit-equality with an uninterrupted run cannot be asked: another world size feeds other
batches (docs/reliability.md).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

from comera_rec.training import load_checkpoint
from tests.reliability.helpers import DEMO, TINY, run_torchrun, train_losses

WORKER = Path(__file__).with_name("dcp_worker.py")
COMMON = TINY + ["trainer.eval_every=0"]
STEP4 = "checkpoints/step_000000004"
# the resumed run validates at its end before it saves again: these follow the validation
CHANGED_BY_VALIDATION = {"trainer.last_eval", "schedule.best_val_loss", "schedule.evals_without_improvement"}

pytestmark = pytest.mark.slow


def _train(tmp: Path, run: Path, nproc: int, steps: int, *extra: str, resume: bool = False) -> None:
    args = ["--config", DEMO, *COMMON, f"trainer.max_steps={steps}", f"trainer.run_dir={run}", *extra]
    proc = run_torchrun(WORKER, args + (["--resume"] if resume else []), tmp, nproc=nproc, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four steps with checkpoints at 2 and 4: one process, and two with table-wise tables
    (these written in the background, trainer.async_checkpoint: the resumes below check that
    a background save of sharded tables holds the whole state)."""
    base = tmp_path_factory.mktemp("written")
    runs = {"one": base / "one", "two_tw": base / "two_tw"}
    _train(base, runs["one"], 1, 4, "trainer.checkpoint_every=2")
    _train(
        base,
        runs["two_tw"],
        2,
        4,
        "trainer.checkpoint_every=2",
        "embedding_optim.sharding_type=table_wise",
        "trainer.async_checkpoint=true",
    )
    return runs


def _differences(a: Any, b: Any, path: str, rowwise: Callable[[str, torch.Tensor], torch.Tensor]) -> list[str]:
    """Where two loaded states differ; ``rowwise(path, saved)`` gives the expected fused
    optimiser accumulator of the resumed plan."""
    if path in CHANGED_BY_VALIDATION:
        return []
    if path == "trainer.data_positions":  # re-split over the new processes: the same rows left, in order
        return [] if _rows_left(a) == _rows_left(b) else [f"{path}: {_rows_left(a)} vs {_rows_left(b)}"]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))[:5]}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}.{k}" if path else str(k), rowwise)]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]", rowwise)]
    if isinstance(a, torch.Tensor):
        if path.startswith("extra_optimizers") and path.endswith("momentum1"):
            want = rowwise(path, a)
            ok = want.shape == b.shape and torch.allclose(want, b, rtol=1e-6, atol=0)
        else:
            ok = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [f"{path}: {tuple(a.shape)} vs {tuple(b.shape)}"]
    return [] if a == b else [f"{path}: {a!r:.80} vs {b!r:.80}"]


def _rows_left(positions: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The rows every process had left, in rank order, as merged intervals."""
    merged: list[tuple[int, int]] = []
    for lo, hi in (iv for p in positions for iv in p["remaining"]):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        elif hi > lo:
            merged.append((lo, hi))
    return merged


def _resume_elsewhere(
    tmp: Path,
    source: Path,
    nproc: int,
    plan: Optional[str],
    rowwise: Callable[[str, torch.Tensor], torch.Tensor],
    train_on: bool = False,
) -> Path:
    """Resume a copy of ``source`` with ``nproc`` processes and ``plan``: the state written
    again equals the state loaded; with ``train_on`` the same launch writes it before its
    first step (dcp_worker.py --save-on-resume) and trains on to step 6."""
    run = tmp / "resumed"
    shutil.copytree(source, run)
    for later in (run / "checkpoints").glob("step_*"):
        if later.name > "step_000000004":  # the copy resumes from step 4
            shutil.rmtree(later)
    extra = [f"embedding_optim.sharding_type={plan}"] if plan else []
    if train_on:
        _train(tmp, run, nproc, 6, "trainer.checkpoint_every=0", *extra, "--save-on-resume", resume=True)
    else:
        _train(tmp, run, nproc, 4, "trainer.checkpoint_every=0", *extra, resume=True)
    saved, saved_meta = load_checkpoint(source / STEP4)
    again, again_meta = load_checkpoint(run / STEP4)
    assert again_meta["world_size"] == nproc and saved_meta["run_id"] == again_meta["run_id"]
    assert saved["model"], "no model state"
    diffs = _differences(saved, again, "", rowwise)
    assert not diffs, diffs[:20]
    if train_on:
        losses = train_losses(run)
        assert {5, 6} <= set(losses) and all(math.isfinite(losses[s]) for s in (5, 6)), losses
    return run


def _same(path: str, saved: torch.Tensor) -> torch.Tensor:
    return saved


def _split_in_two(path: str, saved: torch.Tensor) -> torch.Tensor:
    # table-wise -> two column shards of equal width: each shard starts from the row's value
    return torch.cat([saved, saved])


def test_two_processes_write_one_resumes(tmp_path: Path, written: dict[str, Path]) -> None:
    _resume_elsewhere(tmp_path, written["two_tw"], 1, None, _same)


def test_one_process_writes_two_resume(tmp_path: Path, written: dict[str, Path]) -> None:
    _resume_elsewhere(tmp_path, written["one"], 2, "table_wise", _same)


def test_two_processes_write_four_resume_and_train_on(tmp_path: Path, written: dict[str, Path]) -> None:
    # four processes on this 2-core machine: one thread each, slow but exact
    _resume_elsewhere(tmp_path, written["two_tw"], 4, "table_wise", _same, train_on=True)


def test_table_wise_written_column_wise_resumed_and_back(tmp_path: Path, written: dict[str, Path]) -> None:
    cw = _resume_elsewhere(tmp_path, written["two_tw"], 2, "column_wise", _split_in_two, train_on=True)
    # and back: two column shards merge exactly (the width-weighted mean of the shards)
    back = tmp_path / "back"
    back.mkdir()

    def merge(path: str, saved: torch.Tensor) -> torch.Tensor:
        return saved.reshape(2, -1).mean(dim=0)

    _resume_elsewhere(back, cw, 1, None, merge)


def test_replicated_state_is_stored_once(written: dict[str, Path]) -> None:
    def size(run: Path) -> int:
        return sum(f.stat().st_size for f in (run / STEP4).rglob("*") if f.is_file())

    one, two = size(written["one"]), size(written["two_tw"])
    print(f"checkpoint bytes: 1 process {one}, 2 processes {two} ({two / one:.2f}x)")
    # the TT cores, MLPs and AdamW state are written once, not once per process
    assert two < 1.3 * one, (one, two)


def test_export_of_a_two_process_checkpoint_loads_into_the_model_of_its_config(
    tmp_path: Path, written: dict[str, Path]
) -> None:
    from comera_rec.config import from_dict
    from comera_rec.dlrm.task import DLRMRunConfig, DLRMTask
    from comera_rec.rank import resize_to_state_dict
    from comera_rec.training.checkpoint import main as checkpoint_cli

    out = tmp_path / "model.pt"
    checkpoint_cli(["export", str(written["two_tw"] / "checkpoints"), str(out)])  # the newest: step 4
    exported = torch.load(out, weights_only=True)
    meta = json.loads((written["two_tw"] / STEP4 / "meta.json").read_text())
    # one process, no process group: the model built from the run's config, at the saved ranks
    model = DLRMTask(from_dict(DLRMRunConfig, meta["config"])).build_model(torch.device("cpu"))
    resize_to_state_dict(model, exported)
    model.load_state_dict(exported)  # strict: every key, every shape
    gathered = load_checkpoint(written["two_tw"] / STEP4)[0]["model"]
    tables = [k for k in exported if k.endswith(".weight") and "embedding_bags" in k]
    assert len(tables) == 22  # the dense (not TT) tables, whole
    for k, v in model.state_dict().items():
        assert torch.equal(v, gathered[k]), k


def test_predict_loads_a_two_process_checkpoint_whole(written: dict[str, Path]) -> None:
    from comera_rec.dlrm.predict import load_model

    loaded = load_model(written["two_tw"] / STEP4)  # one process: the sharded tables gathered
    gathered = load_checkpoint(written["two_tw"] / STEP4)[0]["model"]
    state = loaded.model.state_dict()
    assert loaded.step == 4
    for k, v in gathered.items():
        name = next((s for s in state if s.endswith(k)), None)
        assert name is not None, k
        assert torch.equal(state[name], v), k
