"""The fixed-cost copies of the DLRM benchmark (comera_rec/dlrm/bench_fixed.py): each copy goes
without its cost, and until the model trains it computes the model's loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from comera_rec.dlrm import bench_fixed
from comera_rec.dlrm.bench_setup import Setup, build, train_batches
from comera_rec.tensor import kernels
from comera_rec.tensor.linear import TTLinear
from comera_rec.tensor.train import tensor_train_modules

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py

SETUP = replace(Setup(), batch_size=64)


@pytest.fixture(scope="module")
def batch():
    return train_batches(SETUP, False, 1)[0]


def loss_and_grads(wrapped, batch):
    loss, _ = wrapped(batch)
    loss.backward()
    return float(loss.detach())


def test_fixed_merges_merge_nothing_and_give_the_models_first_loss(batch, monkeypatch) -> None:
    model, _ = build("tt", SETUP, mlperf=False)
    copy, _ = build("tt", SETUP, mlperf=False)
    assert bench_fixed.fix_merges(copy) == 4  # the Kaggle MLPs' TT layers (256 -> 64 among them)

    merges = []
    original = kernels.tt_chains_cpu
    monkeypatch.setattr(kernels, "tt_chains_cpu", lambda *a, **k: merges.append(1) or original(*a, **k))
    expected = loss_and_grads(model, batch)
    assert len(merges) == 4
    merges.clear()
    assert loss_and_grads(copy, batch) == pytest.approx(expected, rel=1e-6)
    assert merges == []
    for layer in (m for m in copy.modules() if isinstance(m, TTLinear)):
        assert all(p.grad is None for p in layer.train_tensors())  # no core or controller gradient
        left, right, *_ = layer.chain_operands(torch.empty(0))
        assert left.grad is not None and right.grad is not None  # the fixed chains get theirs


def test_skipped_folds_leave_the_tables_controllers_without_gradient(batch) -> None:
    model, _ = build("tt", SETUP, mlperf=False)
    copy, _ = build("tt", SETUP, mlperf=False)
    assert bench_fixed.skip_folds(copy) == 2  # the two TTM table groups
    # controllers start at 1, where folding them in changes nothing
    assert loss_and_grads(copy, batch) == pytest.approx(loss_and_grads(model, batch), rel=1e-6)

    def tables(wrapped):
        return [m for _, m in tensor_train_modules(wrapped) if not isinstance(m, TTLinear)]

    for theirs, ours in zip(tables(model), tables(copy)):
        assert all(d.grad is not None for d in theirs.controllers)
        assert all(d.grad is None for d in ours.controllers)
        assert all(c.grad is not None for c in ours.cores)


def test_fixed_costs_times_the_model_and_every_copy(capsys) -> None:
    times = bench_fixed.fixed_costs(SETUP, "tt", steps=2, warmup=1)
    assert list(times) == ["model", *bench_fixed.REMOVALS]
    assert all(t > 0 for t in times.values())
    lines = capsys.readouterr().out.splitlines()
    assert "each saving is a bound" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["model", "merges", "folds", "optimizer"]


def test_a_dense_model_is_refused_before_anything_is_built(monkeypatch) -> None:
    monkeypatch.setattr(bench_fixed, "build", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(ValueError, match="'dense': a dense model has no merges or folds"):
        bench_fixed.fixed_cost_times(SETUP, "dense", steps=1, warmup=0)
