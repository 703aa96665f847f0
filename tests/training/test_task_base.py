"""The Task base class: its defaults, hooks looked up on tasks that do not subclass it,
and overridden hooks reaching the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pytest
import torch
from torch import nn
from toy_task import ToyTask

from comera_rec.training import Task, Trainer, TrainerConfig, task_hook
from comera_rec.training.engine import IncompatibleCheckpointError
from comera_rec.training.metrics import BinaryMetrics
from comera_rec.training.trainer_config import OPTIONAL_HOOKS, REQUIRED_HOOKS


class MinimalTask(Task):
    """Only the required hooks, borrowed from the toy task."""

    def __init__(self) -> None:
        self.toy = ToyTask(batches_per_epoch=3, batch=16, val_batches=1)

    def build_model(self, device: torch.device) -> nn.Module:
        return self.toy.build_model(device)

    def wrap(self, model: nn.Module) -> nn.Module:
        return self.toy.wrap(model)

    def train_batches(self, epoch: int) -> Iterable[Any]:
        return self.toy.train_batches(epoch)

    def val_batches(self) -> Iterable[Any]:
        return self.toy.val_batches()

    def step_loss(self, wrapped: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.toy.step_loss(wrapped, batch)


class CountingMetrics(BinaryMetrics):
    def __init__(self, device: torch.device | str, calls: list[str]) -> None:
        super().__init__(device)
        self.calls = calls

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.calls.append("update")
        super().update(logits, labels)


class OverridingTask(MinimalTask):
    """Overrides every optional hook and records the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def optimizer_parameters(self, wrapped: nn.Module) -> list[nn.Parameter]:
        self.calls.append("optimizer_parameters")
        return [p for name, p in wrapped.named_parameters() if not name.startswith("head.")]

    def extra_optimizers(self, wrapped: nn.Module) -> list[Any]:
        self.calls.append("extra_optimizers")
        return [torch.optim.SGD(wrapped.head.parameters(), lr=0.1)]

    def metrics(self, device: torch.device) -> CountingMetrics:
        self.calls.append("metrics")
        return CountingMetrics(device, self.calls)

    def checkpoint_config_keys(self) -> list[str]:
        self.calls.append("checkpoint_config_keys")
        return ["model."]


class RecordingTrainer(Trainer):
    """Records what each optimiser build gave (fit() releases the optimisers at its end)."""

    def _build_optimizers(self, truncation: Any = None) -> None:
        super()._build_optimizers(truncation)
        optimised = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        head = {id(p) for p in self.model.head.parameters()}
        self.built = getattr(self, "built", []) + [(optimised, trainable, head, list(self.extra))]


@dataclass
class RunConfig:
    model: dict[str, int] = field(default_factory=lambda: {"width": 8})


def config(run_dir: Path, steps: int, **kw: Any) -> TrainerConfig:
    base = dict(run_dir=str(run_dir), max_steps=steps, log_every=1, progress=False, plots=False, seed=3)
    base.update(kw)
    return TrainerConfig(**base)


# ---------------------------------------------------------------------- (a) the defaults
def test_defaults_equal_the_former_fallbacks() -> None:
    task = MinimalTask()
    plain = ToyTask()
    for t in (task, plain):
        # the engine used: include=None, no extra optimisers, BinaryMetrics(device), no fixed keys
        assert task_hook(t, "optimizer_parameters")(nn.Linear(2, 1)) is None
        assert task_hook(t, "extra_optimizers")(nn.Linear(2, 1)) == []
        metrics = task_hook(t, "metrics")(torch.device("cpu"))
        assert type(metrics) is BinaryMetrics and metrics.device == torch.device("cpu")
        assert tuple(task_hook(t, "checkpoint_config_keys")()) == ()
        assert task_hook(t, "check_batch")(object()) is None  # checks nothing
    # the subclass inherits them as methods; the plain object gets them bound to itself
    assert task.extra_optimizers(None) == [] and task.checkpoint_config_keys() == ()
    assert task_hook(plain, "metrics").__self__ is plain
    assert task_hook(plain, "build_model") == plain.build_model


def test_required_hooks_raise_and_unknown_hooks_are_refused() -> None:
    class Empty(Task):
        pass

    args = {"build_model": ("cpu",), "wrap": (None,), "train_batches": (0,), "val_batches": (), "step_loss": (None, {})}
    assert set(args) == set(REQUIRED_HOOKS)
    for name, hook_args in args.items():
        with pytest.raises(NotImplementedError, match=f"Empty defines no {name}"):
            getattr(Empty(), name)(*hook_args)
    with pytest.raises(AttributeError, match="no Task hook"):
        task_hook(Empty(), "optimiser_parameters")
    assert set(OPTIONAL_HOOKS) == {
        "check_batch",
        "optimizer_parameters",
        "extra_optimizers",
        "metrics",
        "checkpoint_config_keys",
        "train_position",
        "resume_train_position",
    }


def test_isinstance_stays_structural() -> None:
    # as with the former runtime-checkable Protocol: the required hooks make a Task
    assert isinstance(ToyTask(), Task) and Task not in type(ToyTask()).__mro__
    assert isinstance(MinimalTask(), Task)
    assert not isinstance(object(), Task)


# ---------------------------------------------------------------------- (b) a plain task
def test_plain_task_trains_and_resumes(tmp_path: Path) -> None:
    task = ToyTask(batches_per_epoch=3, batch=16, val_batches=1)
    assert not any(hasattr(task, name) for name in OPTIONAL_HOOKS)
    trainer = RecordingTrainer(task, config(tmp_path, 4), run_config=RunConfig())
    trainer.fit()
    assert trainer.step == 4 and len(trainer.losses) == 4
    optimised, trainable, _, extra = trainer.built[0]
    assert optimised == trainable
    assert extra == []
    assert {"auc", "accuracy", "log_loss"} <= set(trainer.last_eval)

    # a resume checks the config (no fixed keys: a changed model section is only logged)
    resumed = Trainer(
        ToyTask(batches_per_epoch=3, batch=16, val_batches=1),
        config(tmp_path, 6, resume=True),
        run_config=RunConfig(model={"width": 16}),
    )
    resumed.fit()
    assert resumed.step == 6


# ---------------------------------------------------------------------- (c) overrides
def test_overridden_hooks_are_called(tmp_path: Path) -> None:
    task = OverridingTask()
    trainer = RecordingTrainer(task, config(tmp_path, 3), run_config=RunConfig())
    trainer.fit()
    assert {"optimizer_parameters", "extra_optimizers", "metrics", "update"} <= set(task.calls)
    optimised, trainable, head, extra = trainer.built[0]
    assert optimised == trainable - head
    assert len(extra) == 1 and isinstance(extra[0], torch.optim.SGD)

    # the fixed "model." keys make a changed model section fatal on resume
    again = OverridingTask()
    with pytest.raises(IncompatibleCheckpointError, match="config model.width"):
        Trainer(again, config(tmp_path, 5, resume=True), run_config=RunConfig(model={"width": 16})).fit()
    assert "checkpoint_config_keys" in again.calls
