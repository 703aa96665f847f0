"""What data-parallel DLRM training sends per step as the world grows (docs/scaling.md).

Under ``wrap_model`` with a process group (DistributedModelParallel) a step communicates:

* **all-reduce** of every replicated parameter's gradient (DDP: TT cores and controllers,
  MLPs, cross nets), once per step; a ring all-reduce sends ``2 (N-1) / N`` of the bytes;
* **pooled-embedding all-to-all** of the dense (sharded) tables, forward and backward:
  ``batch per rank x features x dim x 4`` bytes each way, a ``(N-1) / N`` share leaving the
  process (the TT tables are replicated and looked up locally: no all-to-all);
* **input all-to-all** of the sharded features' ids and lengths (one-hot here).

:func:`count_model` reads these from a model built on the meta device (nothing allocated),
:func:`step_bytes` turns them into bytes sent per process per step, :func:`comm_time`
projects them onto a stated network (a model, not a measurement), and :func:`measure`
counts what a few real steps send over gloo (a DDP communication hook for the all-reduce,
``torch.distributed.all_to_all_single`` wrapped for the all-to-alls), to check the counts.

    python launch/bench_scaling.py              # counts and the projection (seconds)
    python launch/bench_scaling.py --measure    # + gloo on 1, 2, 4 processes (demo shapes; minutes)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from comera_rec.dlrm.config import DLRMConfig
from comera_rec.integration.collection import TTMEmbeddingBagCollection

FLOAT_BYTES = 4  # fp32 gradients and pooled embeddings
ID_BYTES = 8  # int64 ids
LENGTH_BYTES = 4  # int32 lengths (what TorchRec's input all-to-all sends on gloo; see measure())


@dataclass(frozen=True)
class ModelComm:
    """The communication-relevant sizes of one DLRM."""

    name: str
    replicated_params: int
    """Trainable parameters outside the sharded tables (all-reduced by DDP every step)."""
    tt_table_params: int
    """Of those, the TT tables' cores and controllers."""
    sharded_features: int
    """Features looked up in sharded dense tables (their pooled outputs go through the all-to-all)."""
    sharded_table_params: int
    """Parameters of those tables (sharded: never all-reduced)."""
    embedding_dim: int

    @property
    def mlp_params(self) -> int:
        """Replicated parameters that are not TT tables (MLPs, cross net, interaction)."""
        return self.replicated_params - self.tt_table_params


def count_model(model: nn.Module, name: str = "") -> ModelComm:
    """Sizes of ``model`` (on any device, meta included) that set its per-step communication.

    Example::

        >>> from comera_rec.dlrm.model import build_dlrm
        >>> cfg = DLRMConfig(table_sizes=[1000, 50], embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], compressed=False)
        >>> c = count_model(build_dlrm(cfg, device="meta"))
        >>> c.sharded_features, c.sharded_table_params, c.tt_table_params
        (2, 8400, 0)
    """
    sharded: set[int] = set()
    features = 0
    dims: set[int] = set()
    tt: set[int] = set()
    for _, module in model.named_modules():
        if type(module) is EmbeddingBagCollection:
            sharded |= {id(p) for p in module.parameters()}
            for config in module.embedding_bag_configs():
                features += len(config.feature_names)
                dims.add(config.embedding_dim)
        elif isinstance(module, TTMEmbeddingBagCollection):
            tt |= {id(p) for p in module.parameters()}
            dims |= {c.embedding_dim for c in module.embedding_bag_configs()}
    tt -= sharded
    if len(dims) > 1:
        raise ValueError(f"count_model: tables of several dims {sorted(dims)}; DLRM has one")
    params = [p for p in model.parameters() if p.requires_grad]
    return ModelComm(
        name=name,
        replicated_params=sum(p.numel() for p in params if id(p) not in sharded),
        tt_table_params=sum(p.numel() for p in params if id(p) in tt),
        sharded_features=features,
        sharded_table_params=sum(p.numel() for p in model.parameters() if id(p) in sharded),
        embedding_dim=dims.pop() if dims else 0,
    )


def count_config(config: DLRMConfig, name: str = "") -> ModelComm:
    """:func:`count_model` of the model ``config`` builds, on the meta device."""
    from comera_rec.dlrm.model import build_dlrm

    return count_model(build_dlrm(config, device="meta"), name)


@dataclass(frozen=True)
class StepBytes:
    """Bytes one process sends per training step (its share leaving the process)."""

    allreduce: float
    alltoall_pooled: float
    """Forward and backward together."""
    alltoall_ids: float

    @property
    def total(self) -> float:
        return self.allreduce + self.alltoall_pooled + self.alltoall_ids


def allreduce_payload(comm: ModelComm) -> int:
    """Bytes of gradient DDP all-reduces per step (each process's buffer)."""
    return comm.replicated_params * FLOAT_BYTES


def pooled_payload(comm: ModelComm, batch_per_rank: int) -> int:
    """Bytes of one direction of the pooled-embedding all-to-all, each process's buffer
    (the output it receives equals, on average, the input it sends)."""
    return batch_per_rank * comm.sharded_features * comm.embedding_dim * FLOAT_BYTES


def step_bytes(comm: ModelComm, world: int, batch_per_rank: int, ids_per_sample: float = 1.0) -> StepBytes:
    """Bytes one process sends per step with ``world`` processes (ring all-reduce; all-to-all
    with an even share per peer, averaged over processes).

    Example (one replicated parameter of 1000 floats, 2 features of dim 4, batch 10, 2 processes)::

        >>> c = ModelComm("x", 1000, 0, 2, 0, 4)
        >>> s = step_bytes(c, 2, 10)
        >>> s.allreduce, s.alltoall_pooled, s.alltoall_ids
        (4000.0, 320.0, 120.0)
    """
    if world < 1:
        raise ValueError(f"step_bytes: world={world}")
    leaving = (world - 1) / world
    ids = batch_per_rank * comm.sharded_features * (ids_per_sample * ID_BYTES + LENGTH_BYTES)
    return StepBytes(
        allreduce=2 * leaving * allreduce_payload(comm),
        alltoall_pooled=2 * leaving * pooled_payload(comm, batch_per_rank),
        alltoall_ids=leaving * ids,
    )


@dataclass(frozen=True)
class Network:
    """A stated cluster (the projection's assumptions; docs/scaling.md)."""

    gpus_per_node: int = 8
    intra_GBps: float = 300.0
    """Usable NVLink bandwidth per GPU and direction (H100 NVLink 4: 450 GB/s nominal)."""
    inter_GBps: float = 50.0
    """Per GPU: one 400 Gb/s NIC each (8 x 400 Gb/s per node)."""
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    per_peer_us: float = 0.5
    """All-to-all overhead per peer (N-1 messages per process)."""


def allreduce_time(payload: float, world: int, net: Network) -> float:
    """Seconds for a hierarchical all-reduce of ``payload`` bytes per process: reduce-scatter
    and all-gather inside the node over NVLink, a ring across nodes over each GPU's own NIC
    on its 1/g shard, and a tree-like latency term (a model).

    Example::

        >>> allreduce_time(1e9, 1, Network())
        0.0
    """
    if world <= 1:
        return 0.0
    g = min(world, net.gpus_per_node)
    nodes = math.ceil(world / net.gpus_per_node)
    intra = (
        2 * (g - 1) / g * payload / (net.intra_GBps * 1e9) + 2 * math.ceil(math.log2(g)) * net.intra_latency_us * 1e-6
    )
    if nodes == 1:
        return intra
    inter = 2 * (nodes - 1) / nodes * (payload / g) / (net.inter_GBps * 1e9)
    return intra + inter + 2 * math.ceil(math.log2(nodes)) * net.inter_latency_us * 1e-6


def alltoall_time(payload: float, world: int, net: Network) -> float:
    """Seconds for an all-to-all where each process holds ``payload`` bytes split evenly over
    the ``world`` processes: the node's peers over NVLink and the other nodes over the NIC at
    once, plus latency and a per-peer overhead (a model)."""
    if world <= 1:
        return 0.0
    g = min(world, net.gpus_per_node)
    intra = payload * (g - 1) / world / (net.intra_GBps * 1e9)
    inter = payload * (world - g) / world / (net.inter_GBps * 1e9)
    latency = net.inter_latency_us if world > g else net.intra_latency_us
    return max(intra, inter) + (latency + (world - 1) * net.per_peer_us) * 1e-6


@dataclass(frozen=True)
class StepTime:
    allreduce: float
    alltoall: float
    """Pooled forward + backward and ids, seconds."""

    @property
    def total(self) -> float:
        return self.allreduce + self.alltoall


def comm_time(
    comm: ModelComm, world: int, batch_per_rank: int, net: Network = Network(), ids_per_sample: float = 1.0
) -> StepTime:
    """Modelled communication seconds per step (no overlap with compute counted)."""
    pooled = pooled_payload(comm, batch_per_rank)
    ids = batch_per_rank * comm.sharded_features * (ids_per_sample * ID_BYTES + LENGTH_BYTES)
    a2a = 2 * alltoall_time(pooled, world, net) + alltoall_time(ids, world, net)
    return StepTime(allreduce=allreduce_time(allreduce_payload(comm), world, net), alltoall=a2a)


# --- the shapes the document counts ------------------------------------------------------

KAGGLE_BATCH_PER_RANK = 2048  # the benchmark's batch (dlrm/bench.py), per GPU (weak scaling)
MLPERF_BATCH_PER_RANK = 8192  # MLPerf DLRM-DCNv2 runs global batches of 55-65k on 8 GPUs


def shapes(rank: int = 32) -> dict[str, tuple[DLRMConfig, int]]:
    """The four models of the document and their batch per rank."""
    return {
        "kaggle dense": (DLRMConfig.kaggle(compressed=False), KAGGLE_BATCH_PER_RANK),
        f"kaggle TT r{rank}": (DLRMConfig.kaggle(rank=rank), KAGGLE_BATCH_PER_RANK),
        "mlperf-dcn dense": (DLRMConfig.mlperf_dcn(compressed=False), MLPERF_BATCH_PER_RANK),
        f"mlperf-dcn TT r{rank}": (DLRMConfig.mlperf_dcn(rank=rank), MLPERF_BATCH_PER_RANK),
    }


def mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def us(x: float) -> str:
    return f"{x * 1e6:.0f}"


def counts_table(rank: int = 32, world: int = 8) -> str:
    lines = [
        f"| model | batch/rank | replicated params (TT tables) | sharded features | all-reduce MB | a2a pooled MB | a2a ids MB | total MB (N={world}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (config, batch) in shapes(rank).items():
        c = count_config(config, name)
        s = step_bytes(c, world, batch)
        lines.append(
            f"| {name} | {batch} | {c.replicated_params:,} ({c.tt_table_params:,}) | {c.sharded_features} "
            f"| {mb(s.allreduce)} | {mb(s.alltoall_pooled)} | {mb(s.alltoall_ids)} | {mb(s.total)} |"
        )
    return "\n".join(lines)


WORLDS = (8, 16, 32, 64, 128, 256, 512)


def projection_table(rank: int = 32, net: Network = Network(), worlds: tuple[int, ...] = WORLDS) -> str:
    """Modelled communication microseconds per step: all-reduce / all-to-all / total."""
    lines = ["| model | " + " | ".join(f"N={n}" for n in worlds) + " |", "|---|" + "---|" * len(worlds)]
    for name, (config, batch) in shapes(rank).items():
        c = count_config(config, name)
        cells = []
        for n in worlds:
            t = comm_time(c, n, batch, net)
            cells.append(f"{us(t.allreduce)} / {us(t.alltoall)} / **{us(t.total)}**")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rank_sweep_table(ranks: tuple[int, ...] = (8, 16, 32, 64, 128), world: int = 64, net: Network = Network()) -> str:
    """Compressed models at several ranks against their dense model, at ``world`` GPUs."""
    lines = [
        f"| model | replicated params | replicated bytes w/ AdamW (16 B/param) | all-reduce us | all-to-all us | total us (N={world}) |",
        "|---|---|---|---|---|---|",
    ]
    for base_name, base, batch in (
        ("kaggle", DLRMConfig.kaggle(), KAGGLE_BATCH_PER_RANK),
        ("mlperf-dcn", DLRMConfig.mlperf_dcn(), MLPERF_BATCH_PER_RANK),
    ):
        rows = [("dense", replace(base, compressed=False))] + [(f"TT r{r}", replace(base, rank=r)) for r in ranks]
        for label, config in rows:
            c = count_config(config)
            t = comm_time(c, world, batch, net)
            lines.append(
                f"| {base_name} {label} | {c.replicated_params:,} | {mb(16 * c.replicated_params)} MB "
                f"| {us(t.allreduce)} | {us(t.alltoall)} | {us(t.total)} |"
            )
    return "\n".join(lines)


# --- measurement on gloo -------------------------------------------------------------------


def demo_config(batch_per_rank: int) -> DLRMConfig:
    """The demo config's model section (configs/dlrm_demo.yaml) as a DLRMConfig."""
    import yaml

    from comera_rec.config import from_dict, resolve_config

    data = yaml.safe_load(resolve_config("dlrm_demo").read_text())
    return from_dict(DLRMConfig, data["model"], "model")


def _worker(rank: int, world: int, init: str, out_dir: str, batch_per_rank: int, steps: int, compressed: bool) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
    from comera_rec.dlrm.model import build_dlrm_train
    from comera_rec.integration.distributed import wrap_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    config = replace(demo_config(batch_per_rank), compressed=compressed)
    torch.manual_seed(0)
    model = build_dlrm_train(config, device="meta")
    comm = count_model(model)  # before DMP replaces the tables by sharded ones
    wrapped, optim = wrap_model(model, device="cpu", sharding_type="table_wise")
    counted = {"allreduce_payload": 0, "a2a_float_leaving": 0, "a2a_int_leaving": 0, "a2a_int_by_dtype": {}}

    def hook(state, bucket):
        counted["allreduce_payload"] += bucket.buffer().numel() * bucket.buffer().element_size()
        buffer = bucket.buffer().div_(world)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    ddps = [m for m in wrapped.modules() if isinstance(m, DistributedDataParallel)]
    for ddp in ddps:
        ddp.register_comm_hook(None, hook)
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        row = input[0].numel() if input.dim() > 1 and input.shape[0] else 1
        if input_split_sizes:
            own = input_split_sizes[dist.get_rank(group)] * row
        else:
            own = input.numel() // dist.get_world_size(group)
        leaving = (input.numel() - own) * input.element_size()
        if input.is_floating_point():
            counted["a2a_float_leaving"] += leaving
        else:
            counted["a2a_int_leaving"] += leaving
            key = str(input.dtype)
            counted["a2a_int_by_dtype"][key] = counted["a2a_int_by_dtype"].get(key, 0) + leaving
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    data = SyntheticCriteo(
        SyntheticCriteoConfig(
            num_embeddings_per_feature=list(config.table_sizes),
            batch_size=batch_per_rank,
            num_rows=batch_per_rank * (steps + 1),
            seed=rank,
            stream="train",
            drop_last=True,
        )
    )
    batches = list(iter(data))[: steps + 1]
    dist.all_to_all_single = counting
    try:
        for i, batch in enumerate(batches):
            if i == 1:  # the first step is a warm-up (DDP rebuilds its buckets after it)
                counted.update(allreduce_payload=0, a2a_float_leaving=0, a2a_int_leaving=0, a2a_int_by_dtype={})
            loss, _ = wrapped(batch)
            loss.backward()
            optim.step()
            optim.zero_grad()
    finally:
        dist.all_to_all_single = original
    result = {
        "rank": rank,
        "steps": steps,
        "ddp_modules": len(ddps),
        "counted": asdict(comm),
        "measured": {
            k: (v / steps if isinstance(v, int) else {d: b / steps for d, b in v.items()}) for k, v in counted.items()
        },
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, batch_per_rank: int = 256, steps: int = 2, compressed: bool = True) -> dict:
    """Per-step bytes a few real steps send on gloo with ``world`` processes (the demo model,
    table-wise sharding), averaged over processes, next to :func:`step_bytes` of the same model."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(
            _worker,
            args=(world, init, tmp, batch_per_rank, steps, compressed),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    comm = ModelComm(**results[0]["counted"])
    m = [r["measured"] for r in results]
    leaving = (world - 1) / world
    return {
        "world": world,
        "model": comm,
        "measured_allreduce_payload": sum(x["allreduce_payload"] for x in m) / world,
        "counted_allreduce_payload": allreduce_payload(comm),
        "measured_pooled_leaving": sum(x["a2a_float_leaving"] for x in m) / world,
        "counted_pooled_leaving": 2 * leaving * pooled_payload(comm, batch_per_rank),
        "measured_ids_leaving": sum(x["a2a_int_leaving"] for x in m) / world,
        "measured_ids_by_dtype": {
            d: sum(x["a2a_int_by_dtype"].get(d, 0) for x in m) / world for d in m[0]["a2a_int_by_dtype"]
        },
        "counted_ids_leaving": step_bytes(comm, world, batch_per_rank).alltoall_ids,
    }


def measure_table(worlds: tuple[int, ...] = (1, 2, 4), batch_per_rank: int = 256) -> str:
    lines = [
        "| model | N | all-reduce payload B/step measured / counted | pooled a2a B leaving measured / counted | ids a2a B leaving measured / counted |",
        "|---|---|---|---|---|",
    ]
    for compressed in (True, False):
        for n in worlds:
            r = measure(n, batch_per_rank, compressed=compressed)
            name = "demo TT r16" if compressed else "demo dense"
            lines.append(
                f"| {name} | {n} | {r['measured_allreduce_payload']:,.0f} / {r['counted_allreduce_payload']:,.0f} "
                f"| {r['measured_pooled_leaving']:,.0f} / {r['counted_pooled_leaving']:,.0f} "
                f"| {r['measured_ids_leaving']:,.0f} / {r['counted_ids_leaving']:,.0f} {r['measured_ids_by_dtype']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rank", type=int, default=32, help="TT rank of the compressed models")
    parser.add_argument("--measure", action="store_true", help="also count real steps on gloo with 1, 2, 4 processes")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="process counts for --measure")
    parser.add_argument("--batch-per-rank", type=int, default=256, help="batch per process for --measure")
    args = parser.parse_args(argv)
    print(f"Bytes each process sends per step (counted from the models on the meta device), rank {args.rank}:\n")
    print(counts_table(args.rank))
    net = Network()
    print(f"\nModelled communication per step, microseconds (all-reduce / all-to-all / total); network: {net}\n")
    print(projection_table(args.rank, net))
    print("\nModelled, compressed models by rank against dense, N=64:\n")
    print(rank_sweep_table(world=64, net=net))
    if args.measure:
        print(f"\nMeasured on gloo (demo model, table-wise sharding, batch {args.batch_per_rank} per process):\n")
        print(measure_table(tuple(args.worlds), args.batch_per_rank))


if __name__ == "__main__":
    main()
