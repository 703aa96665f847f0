"""Worker for the two-process DMP test of TTMEmbeddingCollection.

Run under ``torchrun --nproc_per_node=2``: stock ``DistributedModelParallel`` with
TorchRec's ``EmbeddingCollectionSharder`` (the dense table table-wise, SGD fused into
backward; TT cores replicated under DDP) trains a small sequence scorer on its half of
the global batch and writes its parameters to ``OUT_DIR/rank<r>.pt``. The same module
trains the one-process reference on the whole batch (:func:`train_one_process`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.integration import CompressionPolicy, TableOverride
from comera_rec.integration.embedding_collection import TTMEmbeddingCollection

BOUNDS = {"hist": 100, "target": 100, "genre": 20}
GLOBAL_BATCH = 8
STEPS = 4
LR = 0.05
DENSE_TABLE = "genre"


def tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="item", embedding_dim=8, num_embeddings=100, feature_names=["hist", "target"]),
        EmbeddingConfig(name="genre", embedding_dim=8, num_embeddings=20, feature_names=["genre"]),
    ]


class Scorer(nn.Module):
    """Per sample: the sum over its ids (every feature) of ``head(embedding)``."""

    def __init__(self) -> None:
        super().__init__()
        policy = CompressionPolicy(
            rank=3, min_rows_to_compress=50, min_params_to_compress=0, min_gain=0.0,
            per_table={"item": TableOverride(shape=((10, 10), (2, 4)))},
        )  # fmt: skip
        self.ec = TTMEmbeddingCollection(tables(), policy)
        self.head = nn.Linear(8, 1)

    def forward(self, features: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        batch = features.stride()
        scores = torch.zeros(batch)
        for jt in self.ec(features).values():
            sample = torch.repeat_interleave(torch.arange(batch), jt.lengths())
            scores = scores.index_add(0, sample, self.head(jt.values()).squeeze(1))
        return (scores - labels).square().mean()


def dense_init(rows: int, cols: int, row0: int = 0, col0: int = 0) -> torch.Tensor:
    """The dense table's start values, a function of the global (row, column)."""
    r = torch.arange(row0, row0 + rows, dtype=torch.float32).unsqueeze(1)
    c = torch.arange(col0, col0 + cols, dtype=torch.float32).unsqueeze(0)
    return 0.1 * torch.sin(r * 8 + c)


def build() -> Scorer:
    torch.manual_seed(0)
    model = Scorer()
    with torch.no_grad():
        model.ec.dense.embeddings[DENSE_TABLE].weight.copy_(dense_init(20, 8))
    return model


def batch(step: int, lo: int = 0, hi: int = GLOBAL_BATCH) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Samples ``lo:hi`` of the global batch of ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 4, (len(BOUNDS), GLOBAL_BATCH), generator=g)
    ids = [torch.randint(0, n, (int(lengths[f].sum()),), generator=g) for f, n in enumerate(BOUNDS.values())]
    labels = torch.randn(GLOBAL_BATCH, generator=g)
    values, local = [], lengths[:, lo:hi]
    for f in range(len(BOUNDS)):
        start = int(lengths[f, :lo].sum())
        values.append(ids[f][start : start + int(local[f].sum())])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(BOUNDS), values=torch.cat(values), lengths=local.reshape(-1))
    return kjt, labels[lo:hi]


def train_one_process() -> dict[str, torch.Tensor]:
    """The reference: plain SGD on the whole global batch, one process."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss = model(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(out_dir: str) -> None:
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    apply_optimizer_in_backward(torch.optim.SGD, model.ec.dense.parameters(), {"lr": LR})
    sharders = [EmbeddingCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={DENSE_TABLE: ParameterConstraints(sharding_types=["table_wise"])},
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    wrapped = DistributedModelParallel(module=model, device=torch.device("cpu"), sharders=sharders, plan=plan)
    # the sharded table's start values are the reference's (DMP initialises its shards anew)
    key = f"ec.dense.embeddings.{DENSE_TABLE}.weight"
    with torch.no_grad():
        for shard in wrapped.state_dict()[key].local_shards():
            rows, cols = shard.tensor.shape
            shard.tensor.copy_(dense_init(rows, cols, *shard.metadata.shard_offsets))
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(wrapped.named_parameters())), lambda p: torch.optim.SGD(p, lr=LR)
    )
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        loss = wrapped(*batch(step, rank * per_rank, (rank + 1) * per_rank))
        loss.backward()
        dense.step()
        dense.zero_grad()
    state = wrapped.state_dict()
    replicated = {k: v.detach().clone() for k, v in state.items() if not hasattr(v, "local_shards")}
    shards = [
        (k, list(s.metadata.shard_offsets), s.tensor.detach().clone())
        for k, v in state.items()
        if hasattr(v, "local_shards")
        for s in v.local_shards()
    ]
    torch.save({"replicated": replicated, "shards": shards}, f"{out_dir}/rank{rank}.pt")
    del wrapped, dense
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
