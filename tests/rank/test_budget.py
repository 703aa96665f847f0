"""The budget rank schedule: planned sizes, slice entries, Fisher costs, cuts that reach the
target, and a tiny training run that truncates tables and carries the optimiser state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from comera_rec.dlrm.model import build_dlrm_train
from comera_rec.dlrm.task import load_run_config
from comera_rec.rank import RankSchedule, RankScheduleConfig, model_tt_bytes, model_tt_size
from comera_rec.rank.budget import (
    SliceImportance,
    apply_cuts,
    bond_slice_entries,
    cut_plan_steps,
    planned_size,
)
from comera_rec.tensor import TTLinear, TTMEmbeddingBag, tensor_train_modules
from comera_rec.tensor.stacked import StackedTTMTables
from comera_rec.training import OptimConfig, build_optimizer, rebuild_optimizer

ROOT = Path(__file__).resolve().parents[2]


@given(st.integers(0, 50), st.integers(1, 200), st.floats(1.0, 1e6), st.floats(0.01, 0.99))
def test_planned_size_falls_from_start_to_target(start, length, size, ratio):
    end = start + length
    target = size * ratio
    sizes = [planned_size(s, start, end, size, target) for s in range(0, end + 5)]
    assert sizes[0] == size and sizes[-1] == target
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # never grows
    assert all(target <= s <= size for s in sizes)


def test_cut_plan_steps_end_at_the_window_end():
    steps = cut_plan_steps(150, 900, 20)
    assert len(steps) == 20 and steps[-1] == 900 and all(150 < s <= 900 for s in steps)
    assert steps == sorted(set(steps))


@settings(deadline=None, max_examples=25)
@given(st.sampled_from(["linear", "ttm", "stacked"]), st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_bond_slice_entries_is_the_size_a_cut_frees(kind, ranks, data):
    torch.manual_seed(0)
    if kind == "linear":
        module = TTLinear(24, 16, rank=ranks[0])
    elif kind == "ttm":
        module = TTMEmbeddingBag(1000, 8, rank=ranks[0], shape=((10, 10, 10), (2, 2, 2)))
    else:
        module = StackedTTMTables([1000, 800], 8, rank=ranks[0], row_shape=(10, 10, 10), col_shape=(2, 2, 2))
    bond = data.draw(st.integers(0, len(module.ranks) - 1))
    live = module.live_ranks(1e-2)
    if live[bond] < 2:
        return
    before = module.tt_size(1e-2)
    with torch.no_grad():
        module.controllers[bond][..., 0] = 0.0  # dead in every stacked train
    assert before - module.tt_size(1e-2) == bond_slice_entries(module, live)[bond]


def test_fisher_cost_is_invariant_to_the_controller_core_scale_exchange():
    torch.manual_seed(0)
    layer = TTLinear(16, 8, rank=4)
    x = torch.randn(32, 16)
    costs = []
    for scale in (1.0, 8.0):
        model = TTLinear(16, 8, rank=4)
        model.load_state_dict(layer.state_dict())
        with torch.no_grad():  # D_0 -> D_0 / scale, G_0 -> G_0 * scale: the same weight
            model.controllers[0].div_(scale)
            model.cores[0].mul_(scale)
        model(x).pow(2).mean().backward()
        importance = SliceImportance(threshold=0.0)
        importance.observe(model)
        costs.append(importance.costs[("", 0)])
    torch.testing.assert_close(costs[0], costs[1], rtol=1e-4, atol=1e-10)


def toy_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "table": TTMEmbeddingBag(4000, 8, rank=6, shape=((20, 20, 10), (2, 2, 2))),
            "mlp": TTLinear(16, 16, rank=6),
        }
    )


def test_select_reaches_the_target_cheapest_slices_first():
    model = toy_model()
    importance = SliceImportance(threshold=1e-2)
    # costs by hand: slice j of every bond costs j + 1, except bond 0 of the table, whose slice 5 is free
    for name, m in tensor_train_modules(model):
        for k, d in enumerate(m.controllers):
            cost = torch.arange(1.0, d.shape[-1] + 1)
            if name == "table" and k == 0:
                cost[5] = 0.0
            importance.costs[(name, k)] = cost
    importance.steps = 1
    size = model_tt_size(model, 1e-2)
    cuts = importance.select(model, 0.5 * size)
    assert cuts[0].module == "table" and cuts[0].bond == 0 and cuts[0].slice == 5
    apply_cuts(model, cuts)
    after = model_tt_size(model, 1e-2)
    assert after <= 0.5 * size
    assert after > 0.5 * size - max(c.entries for c in cuts)  # stops at the first cut below target
    assert all(r >= 1 for _, m in tensor_train_modules(model) for r in m.live_ranks(1e-2))


def test_module_floor_stops_cuts_at_the_floor():
    model = toy_model()
    importance = SliceImportance(threshold=1e-2)
    for name, m in tensor_train_modules(model):  # the table's slices cost nothing: cut first
        for k, d in enumerate(m.controllers):
            importance.costs[(name, k)] = torch.zeros(d.shape[-1]) if name == "table" else torch.ones(d.shape[-1])
    importance.steps = 1
    table_size = model["table"].tt_size(1e-2)
    size = model_tt_size(model, 1e-2)
    assert table_size > 0.8 * size  # the table holds most of the bytes
    floors = {"table": 0.55 * table_size}
    cuts = importance.select(model, 0.6 * size, module_floors=floors)
    apply_cuts(model, cuts)
    assert model["table"].tt_size(1e-2) >= 0.55 * table_size  # the floor held
    assert any(c.module == "mlp" for c in cuts)  # the rest came from the other module
    assert model_tt_size(model, 1e-2) <= 0.6 * size
    # without the floor only the free table slices are cut
    unfloored = importance.select(toy_model(), 0.6 * size)
    assert {c.module for c in unfloored} == {"table"}


def test_until_floor_rule_reaches_the_target_where_keep_cannot():
    """With every module floored at its whole share (module_floor=1), "keep" stops each module
    above its share, so coarse slices leave the model over the target; "until" cuts a module
    while it is above its share, ending each at most one slice under it, and reaches it."""
    model = toy_model()
    importance = SliceImportance(threshold=1e-2)
    for name, m in tensor_train_modules(model):
        for k, d in enumerate(m.controllers):
            importance.costs[(name, k)] = torch.rand(d.shape[-1], generator=torch.Generator().manual_seed(k))
    importance.steps = 1
    size = model_tt_size(model, 1e-2)
    shares = {name: 0.3 * m.tt_size(1e-2) for name, m in tensor_train_modules(model)}  # sum: the target
    target = 0.3 * size
    keep = toy_model()
    apply_cuts(keep, importance.select(keep, target, module_floors=shares, floor_rule="keep"))
    until = toy_model()
    cuts = importance.select(until, target, module_floors=shares, floor_rule="until")
    apply_cuts(until, cuts)
    assert model_tt_size(keep, 1e-2) > target  # every module held at or above its share
    assert model_tt_size(until, 1e-2) <= target
    largest = max(c.entries for c in cuts)
    for name, m in tensor_train_modules(until):  # each module ends within one slice of its share
        assert shares[name] - largest <= m.tt_size(1e-2), name
    with pytest.raises(ValueError, match="floor_rule"):
        importance.select(toy_model(), target, module_floors=shares, floor_rule="never")
    with pytest.raises(ValueError, match="module_floor_rule"):
        RankScheduleConfig(module_floor_rule="never")


def test_schedule_module_floors_follow_the_target_and_round_trip():
    model = toy_model()
    schedule = RankSchedule(RankScheduleConfig(module_floor=0.5, target_size_ratio=0.2))
    schedule.set_total_steps(100)
    schedule.maybe_switch(0, model)
    floors = schedule.module_floors()
    for name, m in tensor_train_modules(model):
        assert floors[name] == pytest.approx(0.5 * 0.2 * m.tt_size(1e-2), rel=1e-3)
    other = RankSchedule(RankScheduleConfig(module_floor=0.5, target_size_ratio=0.2))
    other.load_state_dict(schedule.state_dict())
    assert other.module_floors() == floors
    assert RankSchedule(RankScheduleConfig(module_floor=0.0)).module_floors() == {}  # 0: no floor
    with pytest.raises(ValueError, match="module_floor"):
        RankScheduleConfig(module_floor=-1.0)
    with pytest.raises(ValueError, match="module_floor must be at most 1"):
        RankScheduleConfig(module_floor=1.5)  # the floors would add up to more than the target


def test_select_keeps_one_slice_per_bond_when_the_target_is_unreachable():
    model = toy_model()
    importance = SliceImportance(threshold=1e-2)
    apply_cuts(model, importance.select(model, 0.0))
    assert all(r == 1 for _, m in tensor_train_modules(model) for r in m.live_ranks(1e-2))


def test_config_rejects_a_bad_window_and_mode():
    with pytest.raises(ValueError, match="prune_start"):
        RankScheduleConfig(prune_start=0.7, prune_end=0.6)
    with pytest.raises(ValueError, match="mode"):
        RankScheduleConfig(mode="gamma")
    with pytest.raises(ValueError, match="num_cuts"):
        RankScheduleConfig(num_cuts=0)
    with pytest.raises(ValueError, match="set_total_steps"):
        RankSchedule(RankScheduleConfig()).window()


def test_budget_run_reaches_its_target_and_slices_the_optimiser_state():
    """A tiny regression trained under the budget schedule: the size ends within 10% of
    the target, the table's ranks fell, and Adam's moments follow the cut parameters."""
    model = toy_model()
    head = nn.Linear(8 + 16, 1)
    model["head"] = head
    cfg = OptimConfig(lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2)
    opt = build_optimizer(model, cfg)
    schedule = RankSchedule(RankScheduleConfig(target_size_ratio=0.3, num_cuts=5))
    steps = 60
    schedule.set_total_steps(steps)
    gen = torch.Generator().manual_seed(1)
    start_size = model_tt_size(model, 1e-2)
    table_ranks = list(model["table"].ranks)
    cut_events = 0
    for step in range(steps):
        ids = torch.randint(0, 4000, (64,), generator=gen)
        x = torch.randn(64, 16, generator=gen)
        y = (ids % 7).float() / 7 + x[:, 0]
        pred = head(torch.cat([model["table"](ids, torch.arange(65)), model["mlp"](x)], dim=1)).squeeze(1)
        terms = schedule.objective(model, (pred - y).pow(2).mean(), step)
        terms.loss.backward()
        schedule.observe_gradients(model)
        opt.step()
        opt.zero_grad()
        if schedule.should_truncate(step + 1) and schedule.truncate(model, step + 1):
            cut_events += 1
            opt = rebuild_optimizer(opt, model, cfg, schedule.last_truncation)
            for p in model.parameters():
                state = opt.state.get(p, {})
                if "exp_avg" in state:
                    assert state["exp_avg"].shape == p.shape
    final = model_tt_size(model, 1e-2)
    target = 0.3 * start_size
    assert cut_events >= 1
    assert abs(final - target) <= 0.1 * target
    assert sum(model["table"].ranks) < sum(table_ranks)  # the table was truncated, not only the MLP
    assert schedule.stage == "finetune"


def test_schedule_state_round_trips_the_starting_size():
    model = toy_model()
    schedule = RankSchedule(RankScheduleConfig())
    schedule.set_total_steps(100)
    schedule.objective(model, torch.tensor(0.5, requires_grad=True), 20)  # inside the window
    assert schedule.stage == "prune" and schedule.size_at_start == model_tt_size(model, 1e-2)
    model["mlp"](torch.randn(4, 16)).pow(2).sum().backward()
    schedule.observe_gradients(model)
    other = RankSchedule(RankScheduleConfig())
    other.load_state_dict(schedule.state_dict())
    assert other.size_at_start == schedule.size_at_start and other.stage == "prune"
    assert other.importance.steps == 1 and set(other.importance.costs) == set(schedule.importance.costs)
    for key, cost in schedule.importance.costs.items():  # the resumed run cuts what this one would
        torch.testing.assert_close(other.importance.costs[key], cost)


@pytest.mark.slow
def test_demo_config_as_shipped_ends_within_ten_percent_of_its_target(tmp_path: Path) -> None:
    """configs/dlrm_demo.yaml with its schedule unchanged (only the run shortened): the TT
    bytes at the end are within 10% of target_size_ratio times the starting bytes."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch/train_dlrm.py"),
            "--config",
            str(ROOT / "configs/dlrm_demo.yaml"),
            "trainer.max_steps=150",
            "trainer.eval_every=0",
            "trainer.eval_max_batches=2",
            "trainer.progress=false",
            "trainer.plots=false",
            "trainer.checkpoint_at_end=false",
            f"trainer.run_dir={run_dir}",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    # the reference: a quarter of the TT bytes of the model the config builds
    config = load_run_config(str(ROOT / "configs/dlrm_demo.yaml"))
    assert config.schedule.mode == "budget" and config.schedule.target_size_ratio == 0.25
    target = 0.25 * model_tt_bytes(build_dlrm_train(config.model, device=torch.device("cpu")))
    assert summary["target_bytes"] == pytest.approx(target, abs=4)
    assert abs(summary["tt_bytes"] - target) <= 0.1 * target
    cut = [r for r in records if r["kind"] == "truncate"]
    tables = [k for k in cut[-1]["ranks_after"] if "embedding_bag_collection" in k]
    assert any(cut[-1]["ranks_after"][k] != cut[0]["ranks_before"][k] for k in tables)  # tables were cut
