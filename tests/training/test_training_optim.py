"""Optimiser groups and the rebuild after a rank truncation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from toy_task import ToyModel, make_batch

from comera_rec.rank import RankSchedule, RankScheduleConfig
from comera_rec.training import OptimConfig, build_optimizer, rebuild_optimizer


def train_steps(model, opt, gen, n, sched=None):
    losses = []
    for _ in range(n):
        b = make_batch(gen, 32)
        loss = F.binary_cross_entropy_with_logits(model(b["dense"], b["ids"], b["offsets"]), b["labels"])
        total = sched.objective(model, loss, 0).loss if sched else loss
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_groups_and_learning_rates():
    model = ToyModel()
    opt = build_optimizer(model, OptimConfig())
    assert isinstance(opt, torch.optim.AdamW)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"cores": 1e-4, "controllers": 1e-3, "other": 5e-5}
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)
    n = {g["name"]: len(g["params"]) for g in opt.param_groups}
    assert n == {"cores": 4 + 2, "controllers": 3 + 1, "other": 3}  # lin.bias, head.weight, head.bias
    for name, cls in [("SGD", torch.optim.SGD), ("Adagrad", torch.optim.Adagrad), ("Adam", torch.optim.Adam)]:
        assert isinstance(build_optimizer(model, OptimConfig(name=name)), cls)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_fused_step_equals_the_foreach_step(name):
    # fused is the default for Adam / AdamW; it must make the same update as the foreach form
    steps = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = ToyModel().double()
        opt = build_optimizer(model, OptimConfig(name=name, fused=fused, lr_other=1e-2, lr_cores=1e-2))
        assert opt.defaults["fused"] is (True if fused else None) and opt.defaults["foreach"] is (
            None if fused else True
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            batch = make_batch(gen, 8)
            model(batch["dense"].double(), batch["ids"], batch["offsets"]).square().sum().backward()
            opt.step()
            opt.zero_grad()
        steps[fused] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(steps[True], steps[False]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_bad_optimizer_name():
    with pytest.raises(ValueError, match="'Lion'"):
        OptimConfig(name="Lion")


def test_include_filters_parameters():
    model = ToyModel()
    opt = build_optimizer(model, OptimConfig(), include=list(model.lin.parameters()))
    assert {g["name"] for g in opt.param_groups} == {"cores", "controllers", "other"}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.lin.parameters()))


@pytest.mark.parametrize("name", ["AdamW", "Adagrad", "SGD"])
def test_rebuild_after_truncation_moves_state(name):
    torch.manual_seed(0)
    model = ToyModel()
    cfg = OptimConfig(name=name, lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2, momentum=0.9)
    opt = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(0)
    train_steps(model, opt, gen, 3)
    opt.param_groups[0]["lr"] = 0.123  # e.g. set by a scheduler: must survive the rebuild
    with torch.no_grad():
        model.lin.controllers[1][torch.tensor([1, 3])] = 0.0
    head_w = model.head.weight
    head_state = {k: v.clone() for k, v in opt.state[head_w].items()}
    old_core = model.lin.cores[1]
    old_core_state = {k: v.clone() for k, v in opt.state[old_core].items()}
    before = sum(p.numel() for p in model.parameters())
    sched = RankSchedule(RankScheduleConfig(mode="threshold"))
    assert sched.truncate(model)
    new = rebuild_optimizer(opt, model, cfg, sched.last_truncation)
    assert sum(p.numel() for p in model.parameters()) < before
    assert new.param_groups[0]["lr"] == 0.123
    # unchanged parameters keep their state exactly
    for k, v in head_state.items():
        assert torch.equal(new.state[head_w][k], v)
    # the cut core's state is the old state at the kept rank indices
    new_core = model.lin.cores[1]
    assert new_core is not old_core and new_core.shape[-1] == 2
    for k, v in old_core_state.items():
        if v.dim() > 0:
            assert torch.equal(new.state[new_core][k], v[:, :, torch.tensor([0, 2])])
        else:
            assert torch.equal(new.state[new_core][k], v)
    # every current parameter is optimised, no stale one
    ids = {id(p) for g in new.param_groups for p in g["params"]}
    assert ids == {id(p) for p in model.parameters()}
    # the model still trains
    losses = train_steps(model, new, gen, 15)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert model.lin.cores[1].grad is None and new.state[model.lin.cores[1]]


def test_lr_factor_warmup_then_decay():
    from comera_rec.training.optim import lr_factor

    cosine = OptimConfig(warmup_steps=4, decay="cosine")
    assert [lr_factor(cosine, s, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(cosine, 8, 12) == pytest.approx(0.5)  # half-way through the decay: cos(pi/2)
    assert lr_factor(cosine, 12, 12) == pytest.approx(0.0)
    assert lr_factor(OptimConfig(warmup_steps=2, decay="linear"), 5, None) == 1.0  # no known end: constant
    assert lr_factor(OptimConfig(), 7, 10) == 1.0
    with pytest.raises(ValueError, match="decay"):
        OptimConfig(decay="step")
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=-1)


def test_set_lr_factor_scales_from_the_configured_rates_and_survives_rebuild():
    from comera_rec.training.optim import set_lr_factor

    model = ToyModel()
    cfg = OptimConfig(lr_cores=1e-2, lr_other=1e-3)
    opt = build_optimizer(model, cfg)
    set_lr_factor([opt], 0.5)
    set_lr_factor([opt], 0.5)  # from the base rate, not compounding
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["cores"] == pytest.approx(5e-3) and lrs["other"] == pytest.approx(5e-4)
    sched = RankSchedule(RankScheduleConfig(mode="threshold", threshold=0.999))
    train_steps(model, opt, torch.Generator().manual_seed(0), 3, sched)
    sched.truncate(model)
    rebuilt = rebuild_optimizer(opt, model, cfg, sched.last_truncation)
    set_lr_factor([rebuilt], 1.0)
    assert {g["name"]: g["lr"] for g in rebuilt.param_groups}["cores"] == pytest.approx(1e-2)


def test_engine_warms_up_learning_rates_with_clipping_on(tmp_path):
    from toy_task import ToyTask

    from comera_rec.training import Trainer, TrainerConfig

    seen = []

    class Watching(ToyTask):
        def step_loss(self, wrapped, batch):
            if trainer.optimizers and wrapped.training:  # not the validation forwards
                seen.append(trainer.optimizers[0].param_groups[0]["lr"])
            return super().step_loss(wrapped, batch)

    trainer = Trainer(
        Watching(batches_per_epoch=8),
        TrainerConfig(run_dir=str(tmp_path), max_steps=4, progress=False, plots=False, checkpoint_at_end=False),
        RankScheduleConfig(enabled=False),
        OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2, warmup_steps=4, clip_grad_norm=1e-3),
    )
    trainer.fit()
    # the rate a step used is visible at the next step's forward: 1/4, 2/4, 3/4 of the base
    assert seen[1:] == pytest.approx([2.5e-3, 5e-3, 7.5e-3])
