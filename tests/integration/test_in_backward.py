"""``apply_optimizer_in_backward`` as TorchRec's examples write it, before or after ``compress``.

TorchRec's examples fuse the tables' optimiser into backward
(``apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), ...)``),
shard with stock ``DistributedModelParallel`` and train the rest with a dense optimiser
over ``in_backward_optimizer_filter(model.named_parameters())``. Before the fix: called
before ``compress`` the tables kept dense lost the optimiser (the sharder fused exact SGD);
called after, the TT cores crashed the backward (``RowWiseAdagrad``: shapes;
``torch.optim.Adagrad`` on CPU: DDP's in-backward hook needs an accelerator).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import comera_rec
from comera_rec.integration import CompressionPolicy, TTMEmbeddingBagCollection
from comera_rec.integration.in_backward import (
    carry_in_backward_optimizers,
    in_backward_spec,
    release_in_backward_optimizers,
)
from tests.integration.helpers import STOCK_DMP_WARNINGS
from tests.integration.test_meta_dmp import DIM, SIZES, _dlrm_batch

CPU = torch.device("cpu")

pytestmark = [
    *STOCK_DMP_WARNINGS,
    pytest.mark.filterwarnings("ignore:This API is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*does not apply to TT parameters:UserWarning"),
]

OPTIMIZERS = {
    "RowWiseAdagrad": (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}
POLICY = CompressionPolicy(rank=4, min_rows_to_compress=50, min_params_to_compress=0, min_gain=0.0)


def _model() -> DLRMTrain:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(SIZES)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=CPU)
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=4,
            dense_arch_layer_sizes=[16, DIM],
            over_arch_layer_sizes=[16, 1],
            dense_device=CPU,
        )
    )


def _table_wise_dmp(model: torch.nn.Module) -> DistributedModelParallel:
    """DMP with the dense table sharded table-wise (so it is a fused FBGEMM table), as a
    user's planner constraints would ask; the stock call otherwise."""
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={"t2": ParameterConstraints(sharding_types=["table_wise"])},
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(module=model, device=CPU, plan=plan, sharders=sharders)


def _train(wrapped: torch.nn.Module, steps: int = 6) -> list[float]:
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(wrapped.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.1),
    )
    optimizer = CombinedOptimizer([wrapped.fused_optimizer, dense])
    batch = _dlrm_batch(0)
    losses = []
    for _ in range(steps):
        loss, _ = wrapped(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _dense_table_momentum(wrapped: DistributedModelParallel) -> list[str]:
    """Keys of the fused optimiser's state for the dense table (row-wise Adagrad keeps a
    momentum per row; fused exact SGD keeps none)."""
    state = wrapped.fused_optimizer.state_dict()["state"]
    return [f"{k}/{s}" for k, v in state.items() if "t2" in k for s in v]


# ---------------------------------------------------------------------------- units


def test_carry_marks_the_replacement_and_its_optimiser_runs_in_backward() -> None:
    old = torch.nn.Parameter(torch.zeros(4, 2))
    apply_optimizer_in_backward(torch.optim.SGD, [old], {"lr": 0.5})
    new = torch.nn.Parameter(torch.ones(4, 2))
    with torch.no_grad():  # as compress() runs
        carry_in_backward_optimizers(old, new)
    assert in_backward_spec(new) == [(torch.optim.SGD, {"lr": 0.5})]
    new.sum().backward()  # the hook steps SGD: 1 - 0.5 * 1
    assert torch.equal(new.detach(), torch.full((4, 2), 0.5))
    assert new.grad is None


def test_release_removes_marks_and_hooks_and_names_the_parameters() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    apply_optimizer_in_backward(torch.optim.SGD, [p], {"lr": 0.5})
    with pytest.warns(
        UserWarning, match=r"Owner: apply_optimizer_in_backward\(SGD\) does not apply to TT parameters \(p\)"
    ):
        released = release_in_backward_optimizers([("p", p), ("q", q)], "Owner")
    assert released == ["p"]
    assert not hasattr(p, "_in_backward_optimizers") and list(in_backward_optimizer_filter([("p", p)])) == [("p", p)]
    p.sum().backward()  # no optimiser runs any more: the gradient stays for the dense optimiser
    assert torch.equal(p.detach(), torch.ones(3)) and torch.equal(p.grad, torch.ones(3))
    assert release_in_backward_optimizers([("p", p)], "Owner") == []


# ---------------------------------------------------------------------------- the pipelines


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_in_backward_before_compress_keeps_the_dense_tables_optimiser(gloo, name: str) -> None:
    cls, kwargs = OPTIMIZERS[name][0], dict(OPTIMIZERS[name][1])  # TorchRec's sharder adds keys to it
    model = _model()
    apply_optimizer_in_backward(cls, model.model.sparse_arch.parameters(), kwargs)
    comera_rec.compress(model, POLICY)
    collection = model.model.sparse_arch.embedding_bag_collection
    assert isinstance(collection, TTMEmbeddingBagCollection) and collection.dense_tables() == ["t2"]
    assert in_backward_spec(collection.dense.embedding_bags["t2"].weight) == [(cls, kwargs)]
    tt_names = [n for n, _ in collection.groups.named_parameters()]
    assert tt_names and not any(hasattr(p, "_in_backward_optimizers") for p in collection.groups.parameters())

    wrapped = _table_wise_dmp(model)
    fused_state = _dense_table_momentum(wrapped)
    if name == "RowWiseAdagrad":  # the user's optimiser, fused (before the fix: exact SGD, no state)
        assert fused_state and all("momentum1" in k for k in fused_state), fused_state
    before = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    table = collection.dense.embedding_bags["t2"].weight if hasattr(collection.dense, "embedding_bags") else None
    losses = _train(wrapped)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    changed = {n for n, p in wrapped.named_parameters() if not torch.equal(before[n], p.detach())}
    assert {n for n in before if ".groups." in n} <= changed  # every TT parameter trained
    dense_table = [n for n in before if "t2" in n]
    assert dense_table == [] or set(dense_table) <= changed
    del wrapped, table


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_in_backward_after_compress_trains_under_stock_dmp(gloo, name: str) -> None:
    cls, kwargs = OPTIMIZERS[name][0], dict(OPTIMIZERS[name][1])  # TorchRec's sharder adds keys to it
    model = _model()
    comera_rec.compress(model, POLICY)
    apply_optimizer_in_backward(cls, model.model.sparse_arch.parameters(), kwargs)
    with pytest.warns(UserWarning, match=rf"apply_optimizer_in_backward\({cls.__name__}\) does not apply to TT"):
        wrapped = DistributedModelParallel(module=model, device=CPU, sharders=[EmbeddingBagCollectionSharder()])
    collection = model.model.sparse_arch.embedding_bag_collection
    assert not any(hasattr(p, "_in_backward_optimizers") for p in collection.groups.parameters())
    before = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    losses = _train(wrapped)  # before the fix: a shape error or "Cannot access accelerator device"
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    changed = {n for n, p in wrapped.named_parameters() if not torch.equal(before[n], p.detach())}
    assert {n for n in before if ".groups." in n} <= changed
    del wrapped


def test_in_backward_after_compress_without_dmp_releases_at_the_first_forward() -> None:
    model = _model()
    comera_rec.compress(model, POLICY)
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.1})
    collection = model.model.sparse_arch.embedding_bag_collection
    dense = torch.optim.Adagrad(dict(in_backward_optimizer_filter(model.named_parameters())).values(), lr=0.1)
    with pytest.warns(UserWarning, match="does not apply to TT parameters"):
        loss, _ = model(_dlrm_batch(0))
    # the dense optimiser was built while the cores were still marked: it leaves them out,
    # so the user rebuilds it after the first forward (or moves the model first, as DMP does)
    cores = list(collection.groups.parameters())
    assert not any(hasattr(p, "_in_backward_optimizers") for p in cores)
    loss.backward()  # no shape error from RowWiseAdagrad on a TT core
    assert all(p.grad is not None for p in cores)
    dense.step()
