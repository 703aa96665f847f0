"""Non-finite losses and gradients: skipped and counted, or a stop with the last good state
saved; NaN weights never reach a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_rec.rank import RankScheduleConfig
from comera_rec.tensor import TTLinear
from comera_rec.training import (
    NonFiniteStateError,
    OptimConfig,
    Trainer,
    TrainerConfig,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


class TinyTask:
    """A TT click model on fixed random batches; chosen batches give a NaN loss or NaN gradients."""

    def __init__(self, nan_loss: tuple[int, ...] = (), nan_grad: tuple[int, ...] = (), batches: int = 6) -> None:
        self.nan_loss, self.nan_grad, self.batches = set(nan_loss), set(nan_grad), batches

    def build_model(self, device: torch.device) -> nn.Module:
        return nn.Sequential(TTLinear(16, 8, rank=2), nn.ReLU(), nn.Linear(8, 1)).to(device)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def _batch(self, gen: torch.Generator, index: int) -> dict:
        x = torch.randn(32, 16, generator=gen)
        return {"x": x, "y": (x[:, 0] > 0).float(), "index": index}

    def train_batches(self, epoch: int) -> Iterator[dict]:
        gen = torch.Generator().manual_seed(epoch)
        for i in range(self.batches):
            yield self._batch(gen, epoch * self.batches + i)

    def val_batches(self) -> Iterator[dict]:
        gen = torch.Generator().manual_seed(99)
        return iter([self._batch(gen, -1) for _ in range(2)])

    def step_loss(self, wrapped: nn.Module, batch: dict):
        x = batch["x"]
        if wrapped.training and batch["index"] in self.nan_grad:
            x = x.clone().requires_grad_(False)
            out = wrapped[0](x)
            out.register_hook(lambda g: torch.full_like(g, math.nan))  # finite loss, NaN gradients
            logits = wrapped[2](wrapped[1](out)).squeeze(-1)
        else:
            logits = wrapped(x).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, batch["y"])
        if wrapped.training and batch["index"] in self.nan_loss:
            loss = loss * math.nan
        return loss, logits, batch["y"]


def trainer(tmp_path: Path, task: TinyTask, **kw) -> Trainer:
    cfg = dict(run_dir=str(tmp_path), max_steps=6, progress=False, plots=False, log_every=1, seed=3)
    cfg.update(kw)
    return Trainer(task, TrainerConfig(**cfg), RankScheduleConfig(), OptimConfig(lr_cores=1e-2, lr_other=1e-2))


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_nan_gradients_are_skipped_like_nan_losses(tmp_path: Path) -> None:
    t = trainer(tmp_path / "a", TinyTask(nan_loss=(1,), nan_grad=(3, 4)))
    summary = t.fit()
    assert summary["nonfinite_skipped"] == 3 and summary["steps"] == 6
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    # the skipped batches changed nothing: the same as a run on the other batches only
    assert len(t.losses) == 3


def test_too_many_nonfinite_stops_with_last_good_state_saved(tmp_path: Path) -> None:
    good = trainer(tmp_path / "good", TinyTask(), max_steps=2, checkpoint_at_end=False)
    good.fit()
    t = trainer(tmp_path / "run", TinyTask(nan_grad=(2, 3, 4)), max_nonfinite=2)
    with pytest.raises(
        FloatingPointError,
        match=r"3 non-finite batches exceed max_nonfinite=2 .*gradients at "
        r"step 5.*last good state is saved in .*step_000000005",
    ):
        t.fit()
    state, meta = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert meta["step"] == 5 and state["trainer"]["nonfinite"] == 3
    for k, v in params(good).items():  # steps 3-5 were skipped: the weights after step 2
        assert torch.equal(state["model"][k], v), k
    strict = trainer(tmp_path / "strict", TinyTask(nan_loss=(1,)), skip_nonfinite=False)
    with pytest.raises(FloatingPointError, match="non-finite loss at step 2; the last good state is saved"):
        strict.fit()
    assert latest_checkpoint(tmp_path / "strict" / "checkpoints").name == "step_000000002"


def test_nan_weights_never_reach_a_checkpoint(tmp_path: Path) -> None:
    t = trainer(tmp_path, TinyTask(), max_steps=2)
    t.fit()
    before = list_checkpoints(tmp_path / "checkpoints")
    t.optimizer = torch.optim.SGD(t.model.parameters())  # fit() released them; save() needs one
    with torch.no_grad():
        t.model[2].weight[0, 3] = math.nan
    t.step = 3
    with pytest.raises(NonFiniteStateError, match=r"refusing to write checkpoint .*step_000000003.*2\.weight"):
        t.save()
    assert list_checkpoints(tmp_path / "checkpoints") == before
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    # optimiser state is checked too, at the lowest level
    with pytest.raises(NonFiniteStateError, match=r"optimizer\.state\.0\.exp_avg"):
        save_checkpoint(
            tmp_path / "c2",
            1,
            {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"exp_avg": torch.tensor([math.inf])}}}},
            {},
        )
    assert not (tmp_path / "c2").exists()
