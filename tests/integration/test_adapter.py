"""``RankAdapter`` in loops this project did not write, and optimiser state after a cut.

The loop is TorchRec's examples' (stock DMP, ``apply_optimizer_in_backward(RowWiseAdagrad)``,
``KeyedOptimizerWrapper`` + ``CombinedOptimizer``) with three added lines
(``tests/integration/adapter_worker.py``); also a plain loop and a bare DDP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from comera_rec import RankAdapter, TTLinear
from comera_rec.rank import RankScheduleConfig
from comera_rec.rank.optim_state import retarget_optimizer
from comera_rec.rank.truncation import truncate_model
from tests.integration import adapter_worker as worker
from tests.integration.helpers import STOCK_DMP_WARNINGS, run_two_process_worker

pytestmark = [
    *STOCK_DMP_WARNINGS,
    pytest.mark.filterwarnings("ignore:This API is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*does not apply to TT parameters:UserWarning"),
]


def _trained_layer(opt_factory) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    layer = TTLinear(16, 8, rank=4)
    opt = opt_factory(layer)
    for _ in range(2):
        layer(torch.randn(5, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return layer, opt


# ---------------------------------------------------------------------------- optimiser state


def _check_sliced(layer: nn.Module, state: dict, before: dict, kept: torch.Tensor) -> None:
    core0, core1, ctrl0 = layer.cores[0], layer.cores[1], layer.controllers[0]
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(state[core0][key], before["core0"][key].index_select(2, kept), rtol=0, atol=0)
        torch.testing.assert_close(state[core1][key], before["core1"][key].index_select(0, kept), rtol=0, atol=0)
        torch.testing.assert_close(state[ctrl0][key], before["ctrl0"][key].index_select(0, kept), rtol=0, atol=0)
    assert float(state[core0]["step"]) == 2.0


def _cut_first_bond(layer: nn.Module):
    with torch.no_grad():
        layer.controllers[0][1] = 0.0
        layer.controllers[0][3] = 0.0
    return truncate_model(layer, 1e-2)


def test_retarget_a_torch_optimizer_slices_its_state() -> None:
    layer, opt = _trained_layer(lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    before = {
        "core0": dict(opt.state[layer.cores[0]]),
        "core1": dict(opt.state[layer.cores[1]]),
        "ctrl0": dict(opt.state[layer.controllers[0]]),
    }
    truncation = _cut_first_bond(layer)
    assert retarget_optimizer(opt, truncation) == 3
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in layer.parameters()}
    assert len(opt.state) == len(list(layer.parameters()))
    _check_sliced(layer, opt.state, before, torch.tensor([0, 2]))
    layer(torch.randn(5, 16)).sum().backward()
    opt.step()  # shapes agree: the step runs


def test_retarget_keyed_optimizers_inside_a_combined_one() -> None:
    def factory(m: nn.Module):
        keyed = KeyedOptimizerWrapper(dict(m.named_parameters()), lambda ps: torch.optim.Adam(ps, lr=0.01))
        return CombinedOptimizer([("dense", keyed)])

    layer, combined = _trained_layer(factory)
    keyed = combined.optimizers[0][1]
    before = {
        "core0": dict(keyed.state[layer.cores[0]]),
        "core1": dict(keyed.state[layer.cores[1]]),
        "ctrl0": dict(keyed.state[layer.controllers[0]]),
    }
    retarget_optimizer(combined, _cut_first_bond(layer))
    assert keyed.params["cores.0"] is layer.cores[0] and keyed.params["controllers.0"] is layer.controllers[0]
    _check_sliced(layer, keyed.state, before, torch.tensor([0, 2]))
    layer(torch.randn(5, 16)).sum().backward()
    combined.step()
    assert set(combined.state_dict()["state"]) >= {"dense.cores.0", "dense.controllers.0"}


# ---------------------------------------------------------------------------- the adapter


def test_adapter_in_a_torchrec_dmp_loop_reaches_its_target(gloo) -> None:
    result = worker.run(rank=0, world=1)
    start, target, final = result["start_bytes"], result["target_bytes"], result["sizes"][-1]
    assert target == pytest.approx(worker.TARGET * start, rel=0.01)
    assert abs(final - target) <= 0.1 * target, (final, target)
    assert sorted(set(result["sizes"]), reverse=True)[1] < start  # cut in several events
    assert result["finite"]
    assert result["missing_from_optimizer"] == [] and result["state_mismatch"] == []
    assert result["stale_ddp"] == []  # DDP rebuilt over the live parameters
    table_ranks = result["ranks"]["model.sparse_arch.embedding_bag_collection.groups.0"]
    assert max(table_ranks) < worker.POLICY.rank  # the tables were cut
    losses = result["losses"]  # the label rule is learnt through the cuts
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8 - 0.02, losses


@pytest.mark.slow
def test_adapter_two_processes_cut_alike(tmp_path: Path) -> None:
    out = run_two_process_worker("adapter_worker.py", tmp_path, timeout=300)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["ranks"] == ranks[1]["ranks"]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]
    for name, value in ranks[0]["tt"].items():  # replicated and in sync after every cut
        torch.testing.assert_close(ranks[1]["tt"][name], value, rtol=0, atol=0, msg=name)
    final, target = ranks[0]["sizes"][-1], ranks[0]["target_bytes"]
    assert abs(final - target) <= 0.1 * target and ranks[0]["finite"]
    assert ranks[0]["stale_ddp"] == [] and ranks[0]["missing_from_optimizer"] == []


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(16, 32, rank=6), nn.ReLU(), TTLinear(32, 1, rank=6))


def _plain_loop(model: nn.Module, adapter: RankAdapter, steps: int, optimizer_of) -> tuple[nn.Module, list[float]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True)
    losses = []
    for _ in range(steps):
        loss = (model(x) - y).pow(2).mean()
        optimizer_of(model).zero_grad()  # zero_grad first, as some loops do
        loss.backward()
        optimizer_of(model).step()
        losses.append(loss.item())
        model = adapter.step(model, optimizer_of(model))
    return model, losses


def test_adapter_in_a_plain_loop() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    adapter = RankAdapter(model, total_steps=60, config=RankScheduleConfig(target_size_ratio=0.4))
    start = adapter.size_bytes(model)
    model, losses = _plain_loop(model, adapter, 60, lambda m: opt)
    assert abs(adapter.size_bytes(model) - 0.4 * start) <= 0.04 * start
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert losses[-1] < losses[0] / 2, losses
    adapter.close()


def test_adapter_rebuilds_a_bare_ddp(gloo) -> None:
    model = nn.parallel.DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    adapter = RankAdapter(model, total_steps=30, config=RankScheduleConfig(target_size_ratio=0.5))
    first = model
    model, losses = _plain_loop(model, adapter, 30, lambda m: opt)
    assert isinstance(model, nn.parallel.DistributedDataParallel) and model is not first
    assert model.module is first.module
    assert {id(p) for p in model.parameters()} == {id(p) for g in opt.param_groups for p in g["params"]}
    assert adapter.size_bytes(model) <= 0.55 * adapter.schedule.size_at_start * 4
    adapter.close()
    del model, first


def test_adapter_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="holds no TT module"):
        RankAdapter(nn.Linear(4, 4), total_steps=10)
    with pytest.raises(ValueError, match="mode='budget'"):
        RankAdapter(_mlp(), total_steps=10, config=RankScheduleConfig(mode="threshold"))
    with pytest.raises(ValueError, match="positive integer"):
        RankAdapter(_mlp(), total_steps=0)
