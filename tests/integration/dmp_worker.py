"""Worker for the two-process DistributedModelParallel equivalence test.

Run under ``torchrun --nproc_per_node=N``: trains a small compressed DLRM on the global
batch split across ranks (TT cores replicated under DDP, dense tables sharded as
``DMP_SHARDING`` says: table-wise by default, or ``column_wise``, or ``planner`` for the
planner's choice)
and writes each rank's parameters to ``OUT_DIR/rank<r>.pt``. The same module builds the
model and batches for the single-process reference.
"""

from __future__ import annotations

import os
import sys

import torch
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.dlrm import criteo_tables, make_dlrm
from comera_rec.integration import CompressionPolicy, TableOverride
from comera_rec.rank.size import model_dense_num_parameters, model_num_parameters

SIZES = [600, 500, 40, 30]  # two TTM tables (stacked), two dense tables
FEATURES = [f"cat_{i}" for i in range(len(SIZES))]
DIM = 4
GLOBAL_BATCH = 8
STEPS = int(os.environ.get("DMP_STEPS", "4"))
TRUNCATE_AT = int(os.environ.get("DMP_TRUNCATE_AT", "2"))  # step after which a rank slice is killed and cut
SHARDING = os.environ.get("DMP_SHARDING", "table_wise")  # of the dense tables; "planner": its choice
LR = 0.05
TABLE_OPTIMIZER = os.environ.get("DMP_TABLE_OPTIMIZER", "SGD")  # of the dense tables: SGD or RowWiseAdagrad


def table_optimizer(name: str = TABLE_OPTIMIZER):
    """The dense tables' optimizer (fused into backward): ``"SGD"`` or ``"RowWiseAdagrad"``."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from comera_rec.integration.distributed import EmbeddingOptimizerSpec

    if name == "RowWiseAdagrad":
        return EmbeddingOptimizerSpec(RowWiseAdagrad, {"lr": LR, "eps": 1e-8})
    return EmbeddingOptimizerSpec(torch.optim.SGD, {"lr": LR})


def build_model() -> DLRMTrain:
    torch.manual_seed(0)
    tables = criteo_tables(SIZES, DIM, FEATURES)
    shared = TableOverride(shape=((25, 24), (2, 2)))  # one TT shape: the two tables are stacked
    policy = CompressionPolicy(
        rank=3,
        min_rows_to_compress=100,
        min_params_to_compress=0,
        min_gain=0.0,
        per_table={"t_cat_0": shared, "t_cat_1": shared},
    )
    model = make_dlrm(tables, dense_in_features=3, bottom_mlp=[16, DIM], top_mlp=[8, 1], policy=policy)
    return DLRMTrain(model)


def make_batch(step: int, start: int = 0, stop: int = GLOBAL_BATCH) -> Batch:
    """Samples [start, stop) of the global batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    dense = torch.rand(GLOBAL_BATCH, 3, generator=g)
    labels = torch.randint(0, 2, (GLOBAL_BATCH,), generator=g)
    lengths = torch.randint(0, 3, (len(SIZES), GLOBAL_BATCH), generator=g)
    ids = [
        [torch.randint(0, n, (int(lengths[f, b]),), generator=g) for b in range(GLOBAL_BATCH)]
        for f, n in enumerate(SIZES)
    ]
    values = torch.cat([ids[f][b] for f in range(len(SIZES)) for b in range(start, stop)])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths[:, start:stop].reshape(-1))
    return Batch(dense_features=dense[start:stop], sparse_features=kjt, labels=labels[start:stop])


def sgd(groups: dict[str, list[torch.nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for ps in groups.values() for p in ps], lr=LR)


def kill_and_truncate(model: torch.nn.Module) -> bool:
    """Zero the last rank slice of the stacked tables' first bond and cut it."""
    ebc = model.model.sparse_arch.embedding_bag_collection
    group = ebc.groups[0]
    with torch.no_grad():
        group.controllers[0][:, -1] = 0.0
    return group.truncate_ranks(1e-6)


def train(wrapped: torch.nn.Module, optim, unwrapped: torch.nn.Module, rank: int, world: int):
    from comera_rec.integration.distributed import replicated_parameter_groups, rewrap_data_parallel

    per = GLOBAL_BATCH // world
    for step in range(STEPS):
        batch = make_batch(step, rank * per, (rank + 1) * per)
        loss, _ = wrapped(batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step + 1 == TRUNCATE_AT:
            assert kill_and_truncate(unwrapped)
            if not os.environ.get("DMP_SKIP_REWRAP"):  # set only to show what goes wrong without it
                wrapped = rewrap_data_parallel(wrapped)
                optim = sgd(replicated_parameter_groups(wrapped))  # plain SGD: no state to carry
    return wrapped, optim


def main(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from comera_rec.integration.distributed import (
        destroy_distributed,
        replicated_parameter_groups,
        wrap_model,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    wrapped, fused = wrap_model(
        model,
        device=torch.device("cpu"),
        world_size=world,
        embedding_optimizer=table_optimizer(),
        sharding_type=None if SHARDING == "planner" else SHARDING,
    )
    optim = sgd(replicated_parameter_groups(wrapped))
    unwrapped = wrapped.module
    wrapped, optim = train(wrapped, optim, unwrapped, rank, world)
    replicated, shards = {}, []
    for name, value in wrapped.state_dict().items():
        name = name.removeprefix("_dmp_wrapped_module.").removeprefix("module.")
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                shards.append((name, list(shard.metadata.shard_offsets), shard.tensor.detach().clone()))
        else:
            replicated[name] = value.detach().clone()
    torch.save(
        {
            "replicated": replicated,
            "shards": shards,
            "ddp_params": sum(1 for _ in wrapped._dmp_wrapped_module.parameters()),
            "sizes": (model_num_parameters(unwrapped), model_dense_num_parameters(unwrapped)),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    del wrapped, optim, fused, unwrapped, model
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
