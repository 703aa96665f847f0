"""A TorchRec training loop as its examples write it, plus ``compress`` and a ``RankAdapter``.

Stock ``DistributedModelParallel``, the tables' optimiser fused into backward
(``apply_optimizer_in_backward(RowWiseAdagrad, ...)``), a dense ``KeyedOptimizerWrapper``
over the rest and a ``CombinedOptimizer`` of both. The comera-rec lines are marked. Run
under ``torchrun --nproc_per_node=N`` it trains on the global batch split across ranks and
writes ``OUT_DIR/rank<r>.pt``; the tests import :func:`run` for one process.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import comera_rec  # comera-rec
from comera_rec.integration import CompressionPolicy
from comera_rec.rank import RankScheduleConfig

SIZES = [600, 500, 40]  # two tables compressed (stacked), one dense
DIM = 8
GLOBAL_BATCH = 16
STEPS = 40
TARGET = 0.3  # of the starting TT size
POLICY = CompressionPolicy(rank=6, min_rows_to_compress=100, min_params_to_compress=0, min_gain=0.0)


def build_model() -> DLRMTrain:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(SIZES)
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=4,
            dense_arch_layer_sizes=[32, DIM],
            over_arch_layer_sizes=[32, 1],
            dense_device=torch.device("cpu"),
        )
    )


def make_batch(step: int, start: int = 0, stop: int = GLOBAL_BATCH) -> Batch:
    """Samples [start, stop) of step ``step``'s global batch (a learnable rule: the label
    follows the first dense feature and the parity of the first table's id)."""
    g = torch.Generator().manual_seed(step % 8)  # 8 batches, seen again and again
    dense = torch.rand(GLOBAL_BATCH, 4, generator=g)
    ids = [torch.randint(0, n, (GLOBAL_BATCH,), generator=g) for n in SIZES]
    labels = ((dense[:, 0] > 0.5) ^ (ids[0] % 2 == 1)).long()
    values = torch.cat([i[start:stop] for i in ids])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(SIZES))],
        values=values,
        lengths=torch.ones(len(SIZES) * (stop - start), dtype=torch.long),
    )
    return Batch(dense_features=dense[start:stop], sparse_features=kjt, labels=labels[start:stop])


def run(rank: int, world: int, adapt: bool = True) -> dict:
    model = build_model()
    comera_rec.compress(model, POLICY)  # comera-rec
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    model = DistributedModelParallel(
        module=model, device=torch.device("cpu"), sharders=[EmbeddingBagCollectionSharder()]
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.Adam(params, lr=0.01)
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    adapter = (
        comera_rec.RankAdapter(
            model,
            total_steps=STEPS,  # comera-rec
            config=RankScheduleConfig(target_size_ratio=TARGET),
        )
        if adapt
        else None
    )
    start_bytes = adapter.size_bytes(model) if adapter else 0
    per = GLOBAL_BATCH // world
    losses, sizes = [], []
    for step in range(STEPS):
        loss, _ = model(make_batch(step, rank * per, (rank + 1) * per))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if adapter is not None:
            model = adapter.step(model, optimizer)  # comera-rec
            sizes.append(adapter.size_bytes(model))
    inner = model.module
    tt = {n: p.detach().clone() for n, p in inner.named_parameters() if ".groups." in n or "._linear." in n}
    in_optimizer = {id(p) for g in dense.param_groups for p in g["params"]}
    missing = [n for n, p in inner.named_parameters() if ".groups." in n and id(p) not in in_optimizer]
    state_mismatch = [
        n
        for n, p in inner.named_parameters()
        if p in dense.state and "exp_avg" in dense.state[p] and dense.state[p]["exp_avg"].shape != p.shape
    ]
    ddp = model._dmp_wrapped_module
    ddp_params = (
        {id(p) for p in ddp.parameters()} if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else set()
    )
    stale_ddp = [n for n, p in inner.named_parameters() if ".groups." in n and id(p) not in ddp_params]
    result = {
        "losses": losses,
        "sizes": sizes,
        "start_bytes": start_bytes,
        "target_bytes": adapter.target_bytes() if adapter else None,
        "tt": tt,
        "missing_from_optimizer": missing,
        "state_mismatch": state_mismatch,
        "stale_ddp": stale_ddp,
        "ranks": {n: list(m.ranks) for n, m in comera_rec.tensor_train_modules(inner)},
        "finite": all(math.isfinite(v) for v in losses),
    }
    if adapter is not None:
        adapter.close()
    del model, optimizer, dense
    return result


def main(out_dir: str) -> None:
    from comera_rec.integration import destroy_distributed

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(run(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
