"""The training step's shared parts (comera_rec/training/step.py): clipping and the
learning-rate schedule, written once for the eager and the graphed step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import comera_rec.training.step as step_module
from comera_rec.rank.schedule import RankSchedule, RankScheduleConfig
from comera_rec.training.optim import OptimConfig, lr_factor
from comera_rec.training.step import (
    EagerStep,
    captured_update,
    check_forward_precision,
    clip_gradients,
    schedule_learning_rates,
)


def _model_with_grads(scale: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clip_gradients_matches_the_global_norm_by_hand(max_norm: float) -> None:
    model = _model_with_grads(3.0)
    before = [p.grad.clone().double() for p in model.parameters()]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in before))
    clip_gradients(model, max_norm)
    factor = 1.0 if max_norm == 0 or norm <= max_norm else max_norm / (float(norm) + 1e-6)
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad.double(), g * factor, rtol=1e-5, atol=1e-7)


def test_schedule_learning_rates_sets_the_factor_of_each_base_rate() -> None:
    model = _model_with_grads(1.0)
    config = OptimConfig(warmup_steps=4, decay="cosine")
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.3}])
    for step in (0, 2, 7):
        schedule_learning_rates([opt], config, step, 12)
        factor = lr_factor(config, step, 12)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * factor, 0.3 * factor])
    untouched = torch.optim.SGD(model.parameters(), lr=0.2)
    schedule_learning_rates([untouched], OptimConfig(), 3, 12)  # no warm-up, no decay: rates kept
    assert untouched.param_groups[0]["lr"] == 0.2


def test_eager_update_equals_the_captured_update() -> None:
    """The eager step's update and what the graphed step captures clip alike and step alike
    (the rates at a fixed factor, as the graphed step sets them on the host first)."""
    config = OptimConfig(clip_grad_norm=0.5)
    results = []
    for which in ("eager", "captured"):
        model = _model_with_grads(3.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if which == "eager":
            trainer = SimpleNamespace(model=model, optimizers=[opt], optim_config=config, step=0)
            EagerStep(trainer).update(total_steps=10)
        else:
            captured_update(model, [opt], config)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    reference = _model_with_grads(3.0)  # and both equal a clip by torch, then SGD by hand
    torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
    for p, out in zip(reference.parameters(), results[0]):
        torch.testing.assert_close(out, p.detach() - 0.1 * p.grad, rtol=1e-6, atol=1e-7)


def _eager_trainer(task, model: nn.Module, autocast: str = "none") -> SimpleNamespace:
    """What the eager step reads of a trainer: its task, model, schedule (off), device, config."""
    schedule = RankSchedule(RankScheduleConfig(enabled=False))
    config = SimpleNamespace(autocast=autocast)
    return SimpleNamespace(
        task=task, wrapped=model, model=model, schedule=schedule, step=0, device=torch.device("cpu"), config=config
    )


def test_eager_forward_backward_runs_the_schedule_objective() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8)

    class Task:
        def step_loss(self, wrapped, batch):
            out = wrapped(batch[0]).squeeze(-1)
            return (out - batch[1]).pow(2).mean(), out, batch[1]

    step = EagerStep(_eager_trainer(Task(), model))
    loss, labels = step.forward((x, y))
    terms = step.backward(loss, float(loss.detach()))
    assert torch.equal(labels, y) and terms.task_loss == pytest.approx(float(loss.detach()))
    expected = torch.autograd.grad((model(x).squeeze(-1) - y).pow(2).mean(), model.weight)[0]
    torch.testing.assert_close(model.weight.grad, expected)


def test_autocast_runs_the_forward_in_bfloat16_and_the_backward_outside() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    seen: dict[str, list] = {"forward": [], "backward": []}
    model.weight.register_hook(lambda g: seen["backward"].append(torch.is_autocast_enabled("cpu")))

    class Task:
        def step_loss(self, wrapped, batch):
            out = wrapped(batch[0]).squeeze(-1)
            seen["forward"].append(out.dtype)
            return (out.float() - batch[1]).pow(2).mean(), out, batch[1]

    x, y = torch.randn(8, 4), torch.randn(8)
    for autocast in ("bfloat16", "none"):
        step = EagerStep(_eager_trainer(Task(), model, autocast))
        loss, _ = step.forward((x, y))
        step.backward(loss, float(loss.detach()))
        assert model.weight.grad.dtype == torch.float32
        model.zero_grad()
    assert seen == {"forward": [torch.bfloat16, torch.float32], "backward": [False, False]}


def test_bfloat16_is_refused_on_a_cpu_without_bfloat16_kernels(monkeypatch) -> None:
    monkeypatch.setattr(step_module, "cpu_bfloat16_products", lambda: False)
    with pytest.raises(
        ValueError, match=r"trainer.autocast='bfloat16' on a CPU .*no bfloat16 matrix kernels.*autocast=none"
    ):
        check_forward_precision(torch.device("cpu"), "bfloat16")
    check_forward_precision(torch.device("cpu"), "none")  # float32 runs on any CPU
    check_forward_precision(torch.device("cuda", 0), "bfloat16")  # a GPU's products are not the CPU's


def test_bfloat16_is_let_through_on_a_cpu_with_bfloat16_kernels(monkeypatch) -> None:
    monkeypatch.setattr(step_module, "cpu_bfloat16_products", lambda: True)
    check_forward_precision(torch.device("cpu"), "bfloat16")
