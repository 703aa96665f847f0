"""The rank-adaptive objective, stage switches, truncation and size accounting."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from comera_rec.rank import (
    RankSchedule,
    RankScheduleConfig,
    model_compression_ratio,
    model_num_bytes,
    model_num_parameters,
    model_tt_bytes,
    model_tt_size,
    resize_to_state_dict,
    truncate_model,
)
from comera_rec.tensor import TTLinear, TTMEmbeddingBag, tensor_train_modules


def toy() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {"lin": TTLinear(16, 8, rank=4), "emb": TTMEmbeddingBag(64, 8, rank=4), "head": nn.Linear(16, 1)}
    )


def all_controllers(model: nn.Module) -> list[torch.Tensor]:
    return [d for _, m in tensor_train_modules(model) for d in m.controllers]


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="'sometimes'"):
        RankScheduleConfig(mode="threshold", switch="sometimes")
    with pytest.raises(ValueError, match="gamma"):
        RankScheduleConfig(mode="threshold", gamma=-1.0)
    with pytest.raises(ValueError, match="switch_size_bytes"):
        RankScheduleConfig(mode="threshold", late_stage=True, switch="size_target")
    with pytest.raises(ValueError, match="target_size_ratio"):
        RankScheduleConfig(mode="threshold", target_size_ratio=0.0)


def test_early_objective_matches_formula():
    model = toy()
    with torch.no_grad():
        all_controllers(model)[0][0] = 0.5
        all_controllers(model)[1][1] = 1e-3  # dead: not in the surrogate
    cfg = RankScheduleConfig(mode="threshold", gamma=0.1, beta=0.01)
    sched = RankSchedule(cfg)
    loss = torch.tensor(0.7, requires_grad=True)
    terms = sched.objective(model, loss, step=0)
    live = [d.abs()[d.abs() >= cfg.threshold] for d in all_controllers(model)]
    s_hat = torch.cat(live).mean()
    g2 = sum(c.pow(2).sum() for _, m in tensor_train_modules(model) for c in m.cores)
    assert terms.stage == "early" and terms.choice is None
    torch.testing.assert_close(terms.loss, 0.7 + 0.1 * s_hat + 0.01 * g2)
    sched_sum = RankSchedule(RankScheduleConfig(mode="threshold", gamma=0.1, surrogate="sum"))
    torch.testing.assert_close(sched_sum.surrogate(model), torch.cat(live).sum())
    terms.loss.backward()
    assert all_controllers(model)[0].grad is not None


def test_disabled_schedule_is_the_task_loss():
    model = toy()
    loss = torch.tensor(0.3, requires_grad=True)
    assert RankSchedule(RankScheduleConfig(mode="threshold", enabled=False)).objective(model, loss, 0).loss is loss


def test_switch_by_step_records_size_at_switch():
    model = toy()
    sched = RankSchedule(RankScheduleConfig(mode="threshold", late_stage=True, switch="step", switch_step=5))
    loss = torch.tensor(0.5, requires_grad=True)
    assert sched.objective(model, loss, 4).stage == "early"
    assert sched.objective(model, loss, 5).stage == "late"
    assert sched.switch_step == 5
    assert sched.size_at_switch == model_tt_size(model, 1e-2)
    assert sched.target_size_elements() == pytest.approx(sched.config.target_size_ratio * sched.size_at_switch)


def test_no_switch_when_late_stage_is_off():
    model = toy()
    sched = RankSchedule(RankScheduleConfig(mode="threshold", late_stage=False, switch="step", switch_step=0))
    assert sched.objective(model, torch.tensor(0.5), 10).stage == "early"


def test_switch_on_validation_plateau():
    model = toy()
    sched = RankSchedule(
        RankScheduleConfig(
            mode="threshold", late_stage=True, switch="plateau", plateau_patience=2, plateau_min_delta=0.01
        )
    )
    assert not sched.observe_validation(10, 0.70, model)
    assert not sched.observe_validation(20, 0.60, model)
    assert not sched.observe_validation(30, 0.595, model)  # below min_delta: 1 without improvement
    assert sched.stage == "early"
    assert sched.observe_validation(40, 0.60, model)  # 2 without improvement: switch
    assert sched.stage == "late" and sched.switch_step == 40
    # the step switch does not fire in plateau mode
    sched2 = RankSchedule(RankScheduleConfig(mode="threshold", late_stage=True, switch="plateau"))
    assert not sched2.maybe_switch(10**6, model)


def test_switch_when_size_target_reached():
    model = toy()
    full = model_tt_bytes(model, 1e-2)
    sched = RankSchedule(
        RankScheduleConfig(mode="threshold", late_stage=True, switch="size_target", switch_size_bytes=full - 1)
    )
    assert not sched.maybe_switch(0, model)
    with torch.no_grad():
        all_controllers(model)[0][1:] = 0.0  # lin's first bond falls from rank 4 to 1
    assert model_tt_bytes(model, 1e-2) < full
    assert sched.maybe_switch(1, model)
    assert sched.stage == "late" and sched.size_at_switch == model_tt_size(model, 1e-2)


def late_schedule(model: nn.Module, **kw) -> RankSchedule:
    sched = RankSchedule(RankScheduleConfig(mode="threshold", late_stage=True, switch="step", switch_step=0, **kw))
    sched.maybe_switch(0, model)
    return sched


def test_late_stage_descends_on_size_when_size_gap_is_larger():
    model = toy()
    # S0 = 0.2 S: size gap 0.8; loss gap (0.5 - 0.45) / 0.5 = 0.1
    sched = late_schedule(model, target_loss=0.45, rho_loss=0.1, rho_size=0.01, w1=1.0, w2=1.0)
    loss = torch.tensor(0.5, requires_grad=True)
    terms = sched.objective(model, loss, 1)
    s_hat = sched.surrogate(model)
    assert terms.choice == "size"
    torch.testing.assert_close(terms.loss, 1.0 * s_hat + 0.1 * 0.5 + 0.01 * s_hat)
    terms.loss.backward()
    assert loss.grad.item() == pytest.approx(0.1)  # only rho_loss on L


def test_late_stage_descends_on_loss_when_loss_gap_is_larger():
    model = toy()
    size = model_tt_size(model, 1e-2)
    bytes_now = model_tt_bytes(model, 1e-2)
    # S0 = 0.9 S (as bytes): size gap 0.1; loss gap (2.0 - 0.2) / 2.0 = 0.9
    sched = late_schedule(model, target_loss=0.2, target_size_bytes=int(0.9 * bytes_now), w1=2.0)
    assert sched.target_size_elements() == pytest.approx(int(0.9 * bytes_now) / 4)
    loss = torch.tensor(2.0, requires_grad=True)
    terms = sched.objective(model, loss, 1)
    assert terms.choice == "loss" and terms.size == size
    torch.testing.assert_close(terms.loss, 2.0 * 2.0 + 0.1 * 2.0 + 0.01 * sched.surrogate(model))
    terms.loss.backward()
    assert loss.grad.item() == pytest.approx(2.1)


def test_late_choice_flips_when_size_reaches_target():
    sched = RankSchedule(RankScheduleConfig(mode="threshold", target_loss=0.4))
    sched.size_at_switch = 1000  # S0 = 200
    assert sched.late_choice(0.5, 900) == "size"
    assert sched.late_choice(0.5, 200) == "loss"  # size gap 0 < loss gap 0.2


def test_should_truncate():
    sched = RankSchedule(RankScheduleConfig(mode="threshold", truncate_every=3))
    assert [s for s in range(10) if sched.should_truncate(s)] == [3, 6, 9]
    assert not any(
        RankSchedule(RankScheduleConfig(mode="threshold", truncate_every=0)).should_truncate(s) for s in range(10)
    )


def test_truncate_cuts_dead_slices_and_keeps_outputs():
    model = toy()
    lin, emb = model["lin"], model["emb"]
    with torch.no_grad():
        lin.controllers[1][torch.tensor([0, 2])] = 0.0
        emb.controllers[0][3] = 0.001
    x = torch.randn(5, 16)
    ids, offsets = torch.tensor([1, 5, 63, 7]), torch.tensor([0, 1, 4])
    y_lin, y_emb = lin(x), emb(ids, offsets)
    old_core1 = lin.cores[1].detach().clone()
    before = model_num_parameters(model, 0.0)
    sched = RankSchedule(RankScheduleConfig(mode="threshold", threshold=1e-2))
    assert sched.truncate(model)
    assert lin.ranks == [4, 2, 4] and emb.ranks == [3]
    assert model_num_parameters(model, 0.0) < before
    torch.testing.assert_close(lin(x), y_lin)
    torch.testing.assert_close(emb(ids, offsets), y_emb, atol=1e-4, rtol=1e-3)
    # the recorded cut reproduces the new parameters from the old ones
    result = sched.last_truncation
    assert result.ranks_after == {"lin": [4, 2, 4], "emb": [3]}
    for change in result.changes:
        torch.testing.assert_close(change.slice(change.old.detach()), change.new.detach())
    assert any(torch.equal(c.slice(old_core1), lin.cores[1].detach()) for c in result.changes if c.new is lin.cores[1])
    assert not sched.truncate(model)  # nothing left to cut


def test_size_and_compression_ratio():
    model = toy()
    lin, emb = model["lin"], model["emb"]
    assert model_tt_size(model) == lin.tt_size() + emb.tt_size()
    assert model_tt_bytes(model) == 4 * model_tt_size(model)
    dense = 16 * 8 + 8 + 64 * 8 + 17
    live = lin.num_parameters() + emb.num_parameters() + 17
    assert model_compression_ratio(model) == pytest.approx(dense / live)
    # every parameter's bytes: the TT modules at their live ranks and the rest (the head)
    assert model_num_bytes(model) == 4 * live
    with torch.no_grad():
        lin.controllers[0][1:] = 0.0
    assert model_num_bytes(model, 1e-2) == 4 * (lin.num_parameters(1e-2) + emb.num_parameters() + 17)
    assert model_num_bytes(model["head"]) == 4 * 17  # a dense model is its parameters, not 0
    assert model_tt_bytes(model["head"]) == 0


def test_resize_to_state_dict_then_load():
    small = toy()
    with torch.no_grad():
        small["lin"].controllers[0][1:] = 0.0
    truncate_model(small, 1e-2)
    big = toy()
    assert resize_to_state_dict(big, small.state_dict())
    big.load_state_dict(small.state_dict())
    assert big["lin"].ranks == small["lin"].ranks == [1, 4, 4]
    x = torch.randn(3, 16)
    torch.testing.assert_close(big["lin"](x), small["lin"](x))


def test_state_dict_roundtrip():
    model = toy()
    sched = late_schedule(model)
    sched.observe_validation(3, 0.5, model)
    state = sched.state_dict()

    def plain(v):  # what a weights-only checkpoint load accepts
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return isinstance(v, (int, float, str))

    assert all(plain(v) for v in state.values())
    other = RankSchedule(RankScheduleConfig(mode="threshold"))
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.stage == "late" and not math.isinf(other.best_val_loss)
