"""TorchRec training pipelines as TorchRec's examples write them, stock and compressed.

Each style is the ordinary TorchRec code; the compressed version adds only the lines
marked ``# comera-rec``:

* ``dcn``: ``DLRMTrain(DLRM_DCN(...))`` with its ``EmbeddingBagCollection`` on ``meta``,
  ``apply_optimizer_in_backward(RowWiseAdagrad, sparse_arch.parameters())``, stock
  ``DistributedModelParallel`` with a table-wise plan, and a ``CombinedOptimizer`` of
  ``model.fused_optimizer`` and a ``KeyedOptimizerWrapper`` over
  ``in_backward_optimizer_filter(...)``.
* ``tower``: a two-tower retrieval model (a query and a candidate
  ``EmbeddingBagCollection``, each followed by a small MLP, dot-product logits, BCE on
  the labels of the batch's pairs), the same DMP and optimiser setup without the
  in-backward call (the sharder's fused SGD).
* ``pipeline_adapter``: the compressed ``dcn`` model trained by
  ``TrainPipelineSparseDist`` with a ``RankAdapter`` (``model = adapter.step(model,
  optimizer)`` after each ``pipeline.progress``).
* ``tower_adapter``: the compressed ``tower`` model in its own loop with a ``RankAdapter``
  (``model = adapter.step(model, optimizer)`` after each ``optimizer.step()``): one ranking
  over two collections and both towers' MLPs.
* ``seq``: a sequential recommender in the BERT4Rec example's setup: an
  ``EmbeddingCollection`` (an item table read by the user's history and the target item,
  and a genre table) on ``meta``, the history's rows averaged per sample, an MLP to a logit,
  stock DMP with ``EmbeddingCollectionSharder`` (fused SGD), trained by
  ``TrainPipelineSparseDist``.
* ``seq_wrapped``: the compressed ``seq`` model wrapped by ``comera_rec.wrap_model``
  (its planner and sharders, the embedding optimizer in backward) instead of stock DMP.
* ``seq_adapter``: the compressed ``seq`` model trained by ``TrainPipelineSparseDist`` with
  a ``RankAdapter`` (one ranking over the sequence collection's item table and the MLP).

The table-wise plan is there because on CPU TorchRec's planner puts small tables on
``data_parallel``, whose FBGEMM dense lookup has no autograd kernel there: such a table
would never train (docs/torchrec.md). DMP initialises each shard on the rank that holds
it, so the draws depend on the world size; to compare runs, every run starts from the
same values (:func:`initial_state`, copied in after DMP).

Run under ``torchrun --nproc_per_node=N`` with ``OUT_DIR [STYLE ...]`` it trains on the
global batch split across ranks and writes ``OUT_DIR/<style>.rank<r>.pt``; the tests call
:func:`run` for one process.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mlp import MLP
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import comera_rec  # comera-rec
from comera_rec.integration import CompressionPolicy, EmbeddingOptimizerSpec
from comera_rec.rank import RankScheduleConfig
from comera_rec.tensor.train import TensorTrainModule

CPU = torch.device("cpu")
META = torch.device("meta")
DIM = 8
DENSE_IN = 4
GLOBAL_BATCH = 16
DISTINCT = 4  # batches, seen again and again
STEPS = 16
ADAPTER_STEPS = 30
TARGET = 0.4  # of the starting TT size
LR = 0.05
TOWER_LR = 0.5  # the towers' tables (fused SGD)
POLICY = CompressionPolicy(rank=4, min_rows_to_compress=100, min_params_to_compress=0, min_gain=0.0)

DCN_SIZES = [600, 500, 40, 30]  # t0, t1 compressed (stacked); t2, t3 dense, one a rank on two
QUERY = {"user": 600, "query_ctx": 40}  # table (= feature) -> rows; the large ones compressed
CANDIDATE = {"item": 500, "item_cat": 30}

SEQ_TABLES = {"item": 600, "genre": 40}  # the item table compressed (read by "history" and "target")
MAX_HISTORY = 5

STYLES = (
    "dcn_stock",
    "dcn_compressed",
    "tower_stock",
    "tower_compressed",
    "pipeline_adapter",
    "tower_adapter",
    "seq_stock",
    "seq_compressed",
    "seq_wrapped",
    "seq_adapter",
)


# ---------------------------------------------------------------------------- shared pieces


def table_wise_plan(model: nn.Module, sharders: list, world: int):
    """TorchRec's planner, every table TorchRec will shard constrained to table-wise."""
    names = [
        c.name for m in model.modules() if isinstance(m, EmbeddingBagCollection) for c in m.embedding_bag_configs()
    ]
    names += [c.name for m in model.modules() if isinstance(m, EmbeddingCollection) for c in m.embedding_configs()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={name: ParameterConstraints(sharding_types=["table_wise"]) for name in names},
    )
    return planner.collective_plan(model, sharders, dist.GroupMember.WORLD)


def plain_name(name: str) -> str:
    return name.removeprefix("_dmp_wrapped_module.").removeprefix("module.")


def initial_state(build: Callable[[torch.device], nn.Module], compressed: bool) -> dict[str, torch.Tensor]:
    """The starting values every run of a style loads: the same model built on the CPU
    (same seed) and, for the compressed style, compressed (TT-SVD of its tables)."""
    model = build(CPU)
    if compressed:
        comera_rec.compress(model, POLICY)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_initial(model: DistributedModelParallel, initial: dict[str, torch.Tensor]) -> None:
    """Copy ``initial`` into the wrapped model: replicated tensors whole, sharded tables
    their local shards (views of FBGEMM's weights)."""
    with torch.no_grad():
        for name, value in model.state_dict().items():
            full = initial[plain_name(name)]
            if isinstance(value, ShardedTensor):
                assert list(value.size()) == list(full.shape), name
                for shard in value.local_shards():
                    rows, cols = shard.tensor.shape
                    r0, c0 = shard.metadata.shard_offsets
                    shard.tensor.copy_(full[r0 : r0 + rows, c0 : c0 + cols])
            else:
                assert value.shape == full.shape, (name, value.shape, full.shape)
                value.copy_(full)


def snapshot(model: DistributedModelParallel) -> tuple[dict[str, torch.Tensor], list]:
    """(replicated tensors by name, [(table name, offsets, local shard)])."""
    replicated, shards = {}, []
    for name, value in model.state_dict().items():
        name = plain_name(name)
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                shards.append((name, list(shard.metadata.shard_offsets), shard.tensor.detach().clone()))
        else:
            replicated[name] = value.detach().clone()
    return replicated, shards


def tt_names(model: nn.Module) -> list[str]:
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    return [
        f"{m_name}.{p_name}"
        for m_name, m in inner.named_modules()
        if isinstance(m, TensorTrainModule)
        for p_name, _ in m.named_parameters()
    ]


def report(model: DistributedModelParallel, initial: dict[str, torch.Tensor], losses: list[float]) -> dict:
    """What the tests check: losses, the trained state, and what did not move."""
    replicated, shards = snapshot(model)
    params = {plain_name(n) for n, _ in model.named_parameters()}
    unchanged = [n for n, v in replicated.items() if n in params and torch.equal(v, initial[n])]
    unchanged_shards = []
    for name, (r0, c0), shard in shards:
        rows, cols = shard.shape
        if torch.equal(shard, initial[name][r0 : r0 + rows, c0 : c0 + cols]):
            unchanged_shards.append(name)
    return {
        "losses": losses,
        "finite": all(math.isfinite(v) for v in losses),
        "replicated": replicated,
        "shards": shards,
        "tt": tt_names(model),
        "unchanged": unchanged,
        "unchanged_shards": unchanged_shards,
        "tables": sorted({name for name, _, _ in shards}),
    }


def make_optimizer(model: DistributedModelParallel) -> CombinedOptimizer:
    """As TorchRec's examples: the sharded tables' fused optimiser and a dense one on the rest."""
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=LR)
    )
    return CombinedOptimizer([model.fused_optimizer, dense])


# ---------------------------------------------------------------------------- (a) DLRM-DCN


def dcn_model(device: torch.device) -> DLRMTrain:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(DCN_SIZES)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=device)
    return DLRMTrain(
        DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE_IN,
            dense_arch_layer_sizes=[16, DIM],
            over_arch_layer_sizes=[32, 1],
            dcn_num_layers=2,
            dcn_low_rank_dim=4,
            dense_device=CPU,
        )
    )


def dcn_batch(step: int, start: int = 0, stop: int = GLOBAL_BATCH) -> Batch:
    """Samples [start, stop) of step ``step``'s global batch; the label follows the first
    dense feature and the parity of the first table's id."""
    g = torch.Generator().manual_seed(step % DISTINCT)
    dense = torch.rand(GLOBAL_BATCH, DENSE_IN, generator=g)
    ids = [torch.randint(0, n, (GLOBAL_BATCH,), generator=g) for n in DCN_SIZES]
    labels = ((dense[:, 0] > 0.5) ^ (ids[0] % 2 == 1)).long()
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(DCN_SIZES))],
        values=torch.cat([i[start:stop] for i in ids]),
        lengths=torch.ones(len(DCN_SIZES) * (stop - start), dtype=torch.long),
    )
    return Batch(dense_features=dense[start:stop], sparse_features=features, labels=labels[start:stop])


def build_dcn(world: int, compressed: bool) -> DistributedModelParallel:
    model = dcn_model(META)
    if compressed:
        comera_rec.compress(model, POLICY)  # comera-rec
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": LR, "eps": 1e-8})
    sharders = [EmbeddingBagCollectionSharder()]
    return DistributedModelParallel(
        module=model, device=CPU, plan=table_wise_plan(model, sharders, world), sharders=sharders
    )


def run_dcn(rank: int, world: int, compressed: bool, autocast: bool = False) -> dict:
    """``autocast``: each forward under ``torch.autocast("cpu", torch.bfloat16)``, as a user's
    mixed-precision loop writes it (the backward outside)."""
    model = build_dcn(world, compressed)
    initial = initial_state(dcn_model, compressed)
    load_initial(model, initial)
    optimizer = make_optimizer(model)
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = model(dcn_batch(step, rank * per, (rank + 1) * per))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return report(model, initial, losses)


# ---------------------------------------------------------------------------- (b) two towers


def _configs(tables: dict[str, int]) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=n, feature_names=[name])
        for name, n in tables.items()
    ]


class Tower(nn.Module):
    """An ``EmbeddingBagCollection`` and a small MLP to the shared embedding space."""

    def __init__(self, tables: dict[str, int], device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=_configs(tables), device=device)
        self.mlp = MLP(in_size=DIM * len(tables), layer_sizes=[32], device=CPU)
        self.proj = nn.Linear(32, DIM, device=CPU)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.proj(self.mlp(self.ebc(features).values()))


class TwoTower(nn.Module):
    """Query and candidate towers; the logit of a pair is the dot product of their outputs."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.query_tower = Tower(QUERY, device)
        self.candidate_tower = Tower(CANDIDATE, device)

    def forward(self, query: KeyedJaggedTensor, candidate: KeyedJaggedTensor) -> torch.Tensor:
        return (self.query_tower(query) * self.candidate_tower(candidate)).sum(dim=1)


class TwoTowerTrain(nn.Module):
    def __init__(self, two_tower: TwoTower) -> None:
        super().__init__()
        self.two_tower = two_tower
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(
        self, query: KeyedJaggedTensor, candidate: KeyedJaggedTensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.two_tower(query, candidate)
        return self.loss_fn(logits, labels.float()), logits.detach()


def tower_model(device: torch.device) -> TwoTowerTrain:
    torch.manual_seed(0)
    return TwoTowerTrain(TwoTower(device))


def tower_batch(step: int, start: int = 0, stop: int = GLOBAL_BATCH):
    """(query KJT, candidate KJT, labels) of samples [start, stop): a pair is positive
    when its query context and its item category have the same parity."""
    g = torch.Generator().manual_seed(100 + step % DISTINCT)
    ids = {name: torch.randint(0, n, (GLOBAL_BATCH,), generator=g) for name, n in {**QUERY, **CANDIDATE}.items()}
    labels = (ids["query_ctx"] % 2 == ids["item_cat"] % 2).long()

    def kjt(tables: dict[str, int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(
            keys=list(tables),
            values=torch.cat([ids[name][start:stop] for name in tables]),
            lengths=torch.ones(len(tables) * (stop - start), dtype=torch.long),
        )

    return kjt(QUERY), kjt(CANDIDATE), labels[start:stop]


def build_tower(world: int, compressed: bool) -> DistributedModelParallel:
    model = tower_model(META)
    if compressed:
        comera_rec.compress(model, POLICY)  # comera-rec
    sharders = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": TOWER_LR})]
    return DistributedModelParallel(
        module=model, device=CPU, plan=table_wise_plan(model, sharders, world), sharders=sharders
    )


def run_tower(rank: int, world: int, compressed: bool) -> dict:
    model = build_tower(world, compressed)
    initial = initial_state(tower_model, compressed)
    load_initial(model, initial)
    optimizer = make_optimizer(model)
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        loss, _ = model(*tower_batch(step, rank * per, (rank + 1) * per))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return report(model, initial, losses)


# ---------------------------------------------------------------------------- (c) sequences


class SequenceModel(nn.Module):
    """A user's history of items (averaged), the target item, its genre and the dense
    features to a logit: the target's click."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="item",
                    embedding_dim=DIM,
                    num_embeddings=SEQ_TABLES["item"],
                    feature_names=["history", "target"],
                ),
                EmbeddingConfig(
                    name="genre", embedding_dim=DIM, num_embeddings=SEQ_TABLES["genre"], feature_names=["genre"]
                ),
            ],
            device=device,
        )
        self.mlp = MLP(in_size=3 * DIM + DENSE_IN, layer_sizes=[32], device=CPU)
        self.out = nn.Linear(32, 1, device=CPU)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        sequences = self.ec(features)
        history = sequences["history"]
        lengths = history.lengths()
        # each row's sample; tensor methods only (TorchRec's pipelines FX-trace this forward)
        sample = torch.repeat_interleave(lengths)
        summed = dense.new_zeros(dense.shape[0], DIM).index_add(0, sample, history.values())
        mean = summed / lengths.unsqueeze(1)  # (B, DIM); every history has a row or more
        x = torch.cat([dense, mean, sequences["target"].values(), sequences["genre"].values()], dim=1)
        return self.out(self.mlp(x)).squeeze(1)


class SequenceTrain(nn.Module):
    """``batch -> (loss, (loss, logits))``, as a train pipeline calls a model (DLRMTrain's
    form: the pipeline steps on the first and hands back the second, detached)."""

    def __init__(self, model: SequenceModel) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach())


def seq_model(device: torch.device) -> SequenceTrain:
    torch.manual_seed(0)
    return SequenceTrain(SequenceModel(device))


def seq_batch(step: int, start: int = 0, stop: int = GLOBAL_BATCH) -> Batch:
    """Samples [start, stop) of step ``step``'s global batch: histories of 1 to
    ``MAX_HISTORY`` items; a click when the target item and the genre have the same parity."""
    g = torch.Generator().manual_seed(200 + step % DISTINCT)
    dense = torch.rand(GLOBAL_BATCH, DENSE_IN, generator=g)
    lengths = torch.randint(1, MAX_HISTORY + 1, (GLOBAL_BATCH,), generator=g)
    history = torch.randint(0, SEQ_TABLES["item"], (int(lengths.sum()),), generator=g)
    target = torch.randint(0, SEQ_TABLES["item"], (GLOBAL_BATCH,), generator=g)
    genre = torch.randint(0, SEQ_TABLES["genre"], (GLOBAL_BATCH,), generator=g)
    labels = (target % 2 == genre % 2).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    mine = slice(start, stop)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["history", "target", "genre"],
        values=torch.cat([history[offsets[start] : offsets[stop]], target[mine], genre[mine]]),
        lengths=torch.cat([lengths[mine], torch.ones(2 * (stop - start), dtype=torch.long)]),
    )
    return Batch(dense_features=dense[mine], sparse_features=features, labels=labels[mine])


def build_seq(world: int, compressed: bool, wrapped: bool = False) -> DistributedModelParallel:
    model = seq_model(META)
    if compressed:
        comera_rec.compress(model, POLICY)  # comera-rec
    if wrapped:
        spec = EmbeddingOptimizerSpec(torch.optim.SGD, {"lr": TOWER_LR})
        return comera_rec.wrap_model(model, device=CPU, embedding_optimizer=spec)[0]
    sharders = [EmbeddingCollectionSharder(fused_params={"learning_rate": TOWER_LR})]
    return DistributedModelParallel(
        module=model, device=CPU, plan=table_wise_plan(model, sharders, world), sharders=sharders
    )


def run_seq(rank: int, world: int, compressed: bool, wrapped: bool = False) -> dict:
    model = build_seq(world, compressed, wrapped)
    initial = initial_state(seq_model, compressed)
    load_initial(model, initial)
    optimizer = make_optimizer(model)
    pipeline = TrainPipelineSparseDist(model, optimizer, CPU)
    per = GLOBAL_BATCH // world
    batches = iter([seq_batch(step, rank * per, (rank + 1) * per) for step in range(STEPS)])
    losses = [pipeline.progress(batches)[0].item() for _ in range(STEPS)]  # (loss, logits) of each step
    collection = model.module.model.ec
    result = report(model, initial, losses)
    # the sharded tables' lookups run in the pipeline's stages (their input is the batch's KJT)
    result["pipelined"] = isinstance((collection.dense if compressed else collection).forward, PipelinedForward)
    del pipeline
    return result


# ---------------------------------------------------------------------------- (d) pipeline + RankAdapter


def tt_numel(model: DistributedModelParallel) -> int:
    return sum(p.numel() for m in model.module.modules() if isinstance(m, TensorTrainModule) for p in m.parameters())


class AdapterProgress:
    """Per step of a loop with a ``RankAdapter``: the loss, the TT size in bytes and in
    parameters, and whether DMP's DDP wrapper was rebuilt (a cut event)."""

    def __init__(self, model: DistributedModelParallel, adapter: comera_rec.RankAdapter) -> None:
        self.adapter = adapter
        self.start_bytes, self.start_numel = adapter.size_bytes(model), tt_numel(model)
        self.losses: list[float] = []
        self.sizes: list[int] = []
        self.numels: list[int] = []
        self.rebuilt: list[bool] = []
        self._ddp = weakref.ref(model._dmp_wrapped_module)  # a reference would keep the old DDP alive

    def record(self, model: DistributedModelParallel, loss: float) -> None:
        self.losses.append(loss)
        self.sizes.append(self.adapter.size_bytes(model))
        self.numels.append(tt_numel(model))
        self.rebuilt.append(self._ddp() is not model._dmp_wrapped_module)  # a new DDP after a cut
        self._ddp = weakref.ref(model._dmp_wrapped_module)


def adapted_report(
    model: DistributedModelParallel,
    initial: dict[str, torch.Tensor],
    optimizer: CombinedOptimizer,
    adapter: comera_rec.RankAdapter,
    progress: AdapterProgress,
) -> dict:
    """:func:`report` and what the adapter tests check: the sizes and cuts over the run, each
    TT module's ranks, and any TT parameter that DDP or the optimiser no longer holds."""
    inner = model.module
    ddp = model._dmp_wrapped_module
    live_ddp = {id(p) for p in ddp.parameters()} if isinstance(ddp, nn.parallel.DistributedDataParallel) else set()
    in_optimizer = {id(p) for _, keyed in optimizer.optimizers for g in keyed.param_groups for p in g["params"]}
    tt_params = [
        (f"{m_name}.{p_name}", p)
        for m_name, m in inner.named_modules()
        if isinstance(m, TensorTrainModule)
        for p_name, p in m.named_parameters()
    ]
    result = report(model, initial, progress.losses)
    result.update(
        {
            "sizes": progress.sizes,
            "numels": progress.numels,
            "start_bytes": progress.start_bytes,
            "start_numel": progress.start_numel,
            "target_bytes": adapter.target_bytes(),
            "rebuilt": progress.rebuilt,
            "ranks": {n: list(m.ranks) for n, m in comera_rec.tensor_train_modules(inner)},
            "stale_ddp": [n for n, p in tt_params if id(p) not in live_ddp],
            "missing_from_optimizer": [n for n, p in tt_params if id(p) not in in_optimizer],
        }
    )
    return result


def start_adapted(
    model: DistributedModelParallel, build: Callable[[torch.device], nn.Module]
) -> tuple[DistributedModelParallel, dict[str, torch.Tensor], CombinedOptimizer, comera_rec.RankAdapter]:
    """The compressed DMP model from the common start (``build``'s initial state), its
    optimiser, and a ``RankAdapter`` over the run (the user's one added line)."""
    initial = initial_state(build, compressed=True)
    load_initial(model, initial)
    optimizer = make_optimizer(model)
    adapter = comera_rec.RankAdapter(
        model,
        total_steps=ADAPTER_STEPS,  # comera-rec
        config=RankScheduleConfig(target_size_ratio=TARGET),
    )
    return model, initial, optimizer, adapter


def run_pipelined_adapter(
    model: DistributedModelParallel,
    build: Callable[[torch.device], nn.Module],
    batch: Callable[[int, int, int], Batch],
    rank: int,
    world: int,
    collection: Callable[[nn.Module], nn.Module],
) -> dict:
    """``model`` trained by ``TrainPipelineSparseDist`` with a ``RankAdapter`` (``model =
    adapter.step(model, optimizer)`` after each ``progress``) on ``batch(step, start,
    stop)``; :func:`adapted_report`, whether the compressed collection's (``collection`` of
    the unwrapped model) dense child ran in the pipeline, and whether the pipeline ended
    with the batches."""
    model, initial, optimizer, adapter = start_adapted(model, build)
    pipeline = TrainPipelineSparseDist(model, optimizer, CPU)
    progress = AdapterProgress(model, adapter)
    per = GLOBAL_BATCH // world
    batches = iter([batch(step, rank * per, (rank + 1) * per) for step in range(ADAPTER_STEPS)])
    for _ in range(ADAPTER_STEPS):
        loss = pipeline.progress(batches)[0]  # the model's second output: (loss, ...)
        model = adapter.step(model, optimizer)  # comera-rec
        progress.record(model, loss.item())
    try:
        pipeline.progress(batches)
        exhausted = False
    except StopIteration:
        exhausted = True
    result = adapted_report(model, initial, optimizer, adapter, progress)
    result["pipelined"] = isinstance(collection(model.module).dense.forward, PipelinedForward)
    result["exhausted"] = exhausted
    adapter.close()
    del pipeline
    return result


def run_pipeline_adapter(rank: int, world: int) -> dict:
    return run_pipelined_adapter(
        build_dcn(world, compressed=True),
        dcn_model,
        dcn_batch,
        rank,
        world,
        lambda m: m.model.sparse_arch.embedding_bag_collection,
    )


def run_seq_adapter(rank: int, world: int) -> dict:
    return run_pipelined_adapter(
        build_seq(world, compressed=True), seq_model, seq_batch, rank, world, lambda m: m.model.ec
    )


def run_tower_adapter(rank: int, world: int) -> dict:
    model, initial, optimizer, adapter = start_adapted(build_tower(world, compressed=True), tower_model)
    progress = AdapterProgress(model, adapter)
    per = GLOBAL_BATCH // world
    for step in range(ADAPTER_STEPS):
        loss, _ = model(*tower_batch(step, rank * per, (rank + 1) * per))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model = adapter.step(model, optimizer)  # comera-rec
        progress.record(model, loss.item())
    result = adapted_report(model, initial, optimizer, adapter, progress)
    adapter.close()
    return result


# ---------------------------------------------------------------------------- entry points


def run(style: str, rank: int, world: int) -> dict:
    """One style on this process's share of each global batch (a process group must exist),
    with the warnings DDP gave of gradients laid out otherwise than its bucket views
    (``layout_warnings``; DDP gives it once a process)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_style(style, rank, world)
    result["layout_warnings"] = [str(w.message) for w in caught if "Grad strides do not match" in str(w.message)]
    return result


def run_style(style: str, rank: int, world: int) -> dict:
    if style == "pipeline_adapter":
        return run_pipeline_adapter(rank, world)
    if style == "tower_adapter":
        return run_tower_adapter(rank, world)
    if style == "seq_adapter":
        return run_seq_adapter(rank, world)
    if style == "seq_wrapped":
        return run_seq(rank, world, compressed=True, wrapped=True)
    kind, version = style.split("_")
    runner = {"dcn": run_dcn, "tower": run_tower, "seq": run_seq}[kind]
    return runner(rank, world, compressed=version == "compressed")


def main(out_dir: str, styles: list[str]) -> None:
    from comera_rec.integration import destroy_distributed

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for style in styles or STYLES:
        torch.save(run(style, rank, world), os.path.join(out_dir, f"{style}.rank{rank}.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
