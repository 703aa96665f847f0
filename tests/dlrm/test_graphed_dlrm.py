"""The DLRM trainer's graphed loop (``trainer.cuda_graphs``) on CPU, through the eager
stand-in capture with the host-sync check: what a CUDA capture of the DLRM step needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec.datasets.utils import Batch

from comera_rec.dlrm.task import DLRMTask, load_run_config
from comera_rec.tensor import set_static_shapes
from comera_rec.training import Trainer
from comera_rec.training.cuda_graph import EagerCapture, forbid_host_syncs, make_static
from tests.dlrm.tiny import ALL_TT, TINY, TWO_CUTS

DEMO = str(Path(__file__).resolve().parents[2] / "configs/dlrm_demo.yaml")


def _run(tmp_path: Path, graphed: bool) -> dict:
    config = load_run_config(
        DEMO,
        [
            *TINY,
            *ALL_TT,
            *TWO_CUTS,
            f"trainer.run_dir={tmp_path / str(graphed)}",
            f"trainer.cuda_graphs={str(graphed).lower()}",
        ],
    )
    capture = EagerCapture(warmup_steps=1, check_syncs=True) if graphed else None
    trainer = Trainer(DLRMTask(config), config.trainer, config.schedule, config.optim, graph_capture=capture)
    summary = trainer.fit()
    return {"summary": summary, "losses": trainer.losses, "log": capture.log if capture else []}


def test_graphed_dlrm_loop_has_no_host_sync_and_trains_as_the_eager_loop(tmp_path: Path) -> None:
    graphed, eager = _run(tmp_path, True), _run(tmp_path, False)
    assert graphed["log"].count("capture") >= 2 and graphed["log"].count("replay") >= 10  # re-captured after cuts
    assert graphed["summary"]["truncations"] == eager["summary"]["truncations"] >= 1
    assert len(graphed["losses"]) == len(eager["losses"]) == 20
    # static-shape lookups sum in another order than the de-duplicated eager ones
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=1e-4, abs=1e-5)


def test_bad_labels_are_named_outside_the_capture(tmp_path: Path) -> None:
    """Inside a capture the task's step skips its host checks (they would read the device,
    and a replay would not run them); ``check_batch`` runs them on the host instead."""
    config = load_run_config(DEMO, [*TINY, *ALL_TT, f"trainer.run_dir={tmp_path}"])
    task = DLRMTask(config)
    wrapped = task.wrap(task.build_model(torch.device("cpu")))
    set_static_shapes(wrapped)  # as the graphed engine does
    good = next(iter(task.train_batches(0)))
    bad = Batch(good.dense_features, good.sparse_features, torch.full_like(good.labels, -1.0))
    with pytest.raises(ValueError, match="labels must be 0 or 1 for training, got -1.0"):
        task.check_batch(bad)
    with pytest.raises(ValueError, match="labels must be 0 or 1 for training"):
        task.step_loss(wrapped, bad)  # eager: the step checks
    task.check_batch(good)
    task.step_loss(wrapped, good)  # the warm-up step (makes the per-device constants)
    static_bad = make_static(bad, "cpu")  # as the graphed step holds a batch
    with forbid_host_syncs():  # captured: no host read, so no check in the step
        loss, _, _ = task.step_loss(wrapped, static_bad)
    assert loss.shape == ()
