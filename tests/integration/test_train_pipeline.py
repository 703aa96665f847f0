"""TorchRec's ``TrainPipelineSparseDist`` on compressed models, user code unchanged.

The pipeline FX-traces the model to find each sharded module and the part of the batch
it reads, then runs that module's input distribution one batch ahead. A
``TTMEmbeddingBagCollection`` holds its dense tables in a TorchRec
``EmbeddingBagCollection`` (``dense``) that DMP shards, so the tracer enters the
collection; with every table compressed nothing is sharded and it traces the whole model,
``TTLinear`` layers included. Here a small TorchRec DLRM, built on ``meta`` and
compressed, is wrapped by the stock DMP call and trained by the stock pipeline: it must
train as the same model in a plain loop on the same batches, and with a dense child the
child's input distribution must be pipelined.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.types import ShardedModule
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import comera_rec
from comera_rec import TTLinear
from comera_rec.integration import CompressionPolicy, TTMEmbeddingBagCollection, destroy_distributed
from comera_rec.tensor.train import TensorTrainModule
from tests.integration.helpers import STOCK_DMP_WARNINGS

CPU = torch.device("cpu")
DIM = 8
DENSE_IN = 4
LR = 0.1
SOME = [100, 90, 20]  # t0, t1 compressed (stacked), t2 dense: a sharded `dense` child
SOME_TWO_DENSE = [100, 90, 20, 30]  # two processes: t2, t3 dense, one table a rank
ALL = [100, 90, 60]  # every table compressed: nothing in the model is sharded
POLICY = CompressionPolicy(rank=4, min_rows_to_compress=50, min_params_to_compress=0, min_gain=0.0)
DISTINCT, ROUNDS = 2, 3  # the batches, and how often each is seen

# TorchRec's own warnings about its defaults (as in test_meta_dmp.py); the small dense table
# the planner puts on data_parallel gets FBGEMM's dense CPU lookup, which has no autograd
# kernel (the known CPU limit, docs/torchrec.md); DDP notes the strides of (r, n, 1) cores.
pytestmark = [
    *STOCK_DMP_WARNINGS,
]


def build(sizes: list[int], sharding: str, world_size: int = 1) -> DistributedModelParallel:
    """A TorchRec DLRM on ``meta``, compressed, under DMP: the planner's plan
    (``"planner"``: the dense table data-parallel on one rank) or the dense tables
    ``"table_wise"`` (FBGEMM, their optimizer fused into backward). Same seed, same model."""
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(sizes)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE_IN,
            dense_arch_layer_sizes=[16, DIM],
            over_arch_layer_sizes=[16, 1],
            dense_device=CPU,
        )
    )
    comera_rec.compress(model, POLICY)
    sharders = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": LR})]
    if sharding == "planner":
        return DistributedModelParallel(module=model, device=CPU, sharders=sharders)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(2, len(sizes))},
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(module=model, device=CPU, plan=plan, sharders=sharders)


def make_optimizer(model: DistributedModelParallel) -> CombinedOptimizer:
    """As TorchRec's examples: the sharded tables' fused optimizer and SGD on the rest."""
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.SGD(params, lr=LR)
    )
    return CombinedOptimizer([model.fused_optimizer, dense])


def make_batch(sizes: list[int], seed: int, batch: int = 16) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(sizes), batch), generator=g)
    values = torch.cat([torch.randint(0, n, (int(lengths[f].sum()),), generator=g) for f, n in enumerate(sizes)])
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(sizes))], values=values, lengths=lengths.reshape(-1)
    )
    dense = torch.rand(batch, DENSE_IN, generator=g)
    labels = (dense.sum(1) > DENSE_IN / 2).long()  # learnable from the dense features
    return Batch(dense_features=dense, sparse_features=features, labels=labels)


def collection_of(model: DistributedModelParallel) -> TTMEmbeddingBagCollection:
    return model.module.model.sparse_arch.embedding_bag_collection


def tt_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{p_name}": p
        for name, m in model.named_modules()
        if isinstance(m, TensorTrainModule)
        for p_name, p in m.named_parameters()
    }


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, detached copies (a sharded table: its local
    shards, stacked; a table held by another rank: empty)."""
    state = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "local_shards"):  # a ShardedTensor
            shards = [s.tensor.detach() for s in value.local_shards()]
            value = torch.cat(shards) if shards else torch.empty(0)
        state[name] = value.detach().clone()
    return state


def plain_loop(model: DistributedModelParallel, batches: list[Batch]) -> list[float]:
    optimizer = make_optimizer(model)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "sizes, sharding, eager_steps",
    [
        pytest.param(SOME, "planner", 0, id="some-compressed"),
        pytest.param(SOME, "table_wise", 1, id="some-compressed-table-wise-after-eager-step"),
        pytest.param(ALL, "planner", 0, id="all-compressed"),
    ],
)
def test_sparse_dist_pipeline_trains_as_plain_loop(gloo, sizes: list[int], sharding: str, eager_steps: int) -> None:
    batches = [make_batch(sizes, seed % DISTINCT) for seed in range(DISTINCT * ROUNDS)]

    reference = build(sizes, sharding)
    expected_losses = plain_loop(reference, batches)
    expected = trained_state(reference)
    del reference

    model = build(sizes, sharding)
    collection = collection_of(model)
    assert isinstance(collection, TTMEmbeddingBagCollection)
    if sizes is SOME:
        assert collection.dense_tables() == ["t2"] and isinstance(collection.dense, ShardedModule)
    else:
        assert collection.dense is None
        assert not any(isinstance(m, ShardedModule) for m in model.modules())
    assert any(isinstance(m, TTLinear) for m in model.modules())  # the MLPs' layers are traced too
    initial = {n: p.detach().clone() for n, p in tt_parameters(model).items()}
    assert initial
    before = trained_state(model)

    # the same model, first some plain steps (the dense child's input dist is set up
    # there), then TorchRec's pipeline on the rest of the batches
    losses = plain_loop(model, batches[:eager_steps])
    pipeline = TrainPipelineSparseDist(model, make_optimizer(model), CPU)
    stream = iter(batches[eager_steps:])
    for _ in batches[eager_steps:]:
        loss, _logits, _labels = pipeline.progress(stream)
        losses.append(loss.item())
    with pytest.raises(StopIteration):
        pipeline.progress(stream)

    if sizes is SOME:  # its input distribution runs a batch ahead, in the pipeline
        assert isinstance(collection.dense.forward, PipelinedForward)
    assert all(math.isfinite(v) for v in losses), losses
    for b in range(DISTINCT):  # each batch's loss falls from round to round
        seen = losses[b::DISTINCT]
        assert all(later < earlier for earlier, later in zip(seen, seen[1:])), (b, seen)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
    got = trained_state(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    unchanged = [n for n, p in tt_parameters(model).items() if torch.equal(p.detach(), initial[n])]
    assert not unchanged, unchanged
    if sharding == "table_wise":  # the sharded dense table trained too (its fused optimizer)
        (table,) = [n for n in got if n.endswith("dense.embedding_bags.t2.weight")]
        assert not torch.equal(got[table], before[table])


def test_freeing_the_batch_early_is_refused(gloo) -> None:
    """``free_features_storage_early=True`` frees the batch KJT once the sharded modules'
    input dists have read it; the TTM tables read it after: a clear error, not a crash in
    a kernel."""
    model = build(SOME, "planner")
    pipeline = TrainPipelineSparseDist(model, make_optimizer(model), CPU, free_features_storage_early=True)
    with pytest.raises(RuntimeError, match="free_features_storage_early"):
        pipeline.progress(iter([make_batch(SOME, seed) for seed in range(3)]))


# ---------------------------------------------------------------------------- two processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_process_sparse_dist_pipeline_trains_as_plain_loop(tmp_path: Path) -> None:
    """Under torchrun, two ranks, each its own batches, the dense tables table-wise (one a
    rank: a real all-to-all input distribution): on every rank the pipeline trains as the
    plain loop, the dense child pipelined."""
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__, str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    held = []
    for r in ranks:
        assert r["pipelined"]
        assert all(math.isfinite(v) for v in r["losses"])
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["expected_losses"]), rtol=1e-5, atol=1e-6)
        assert r["state"].keys() == r["expected"].keys()
        for name, value in r["expected"].items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        held.append({n for n, v in r["state"].items() if "dense.embedding_bags" in n and v.numel()})
    assert held[0] and held[1] and not held[0] & held[1]  # the dense tables: one on each rank
    for name in ranks[0]["tt"]:  # replicated TT parameters: the same on both ranks
        torch.testing.assert_close(ranks[1]["tt"][name], ranks[0]["tt"][name], rtol=0, atol=0)


def _two_process_worker(out_dir: str) -> None:
    """One rank of the test above: the plain loop, then the pipeline, on this rank's batches."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = SOME_TWO_DENSE
    batches = [make_batch(sizes, 100 * rank + seed % DISTINCT, batch=8) for seed in range(DISTINCT * ROUNDS)]
    reference = build(sizes, "table_wise", world)
    expected_losses = plain_loop(reference, batches)
    expected = trained_state(reference)
    del reference
    model = build(sizes, "table_wise", world)
    pipeline = TrainPipelineSparseDist(model, make_optimizer(model), CPU)
    stream = iter(batches)
    losses = [pipeline.progress(stream)[0].item() for _ in batches]
    torch.save(
        {
            "losses": losses,
            "expected_losses": expected_losses,
            "state": trained_state(model),
            "expected": expected,
            "pipelined": isinstance(collection_of(model).dense.forward, PipelinedForward),
            "tt": {n: p.detach().clone() for n, p in tt_parameters(model).items()},
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    del pipeline, model
    destroy_distributed()


if __name__ == "__main__":
    _two_process_worker(sys.argv[1])
