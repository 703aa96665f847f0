"""What a few real data-parallel DLRM steps send on gloo (:mod:`comera_rec.dlrm.scaling`,
``--measure``): processes that train the demo model with DDP's all-reduce and the
all-to-alls counted, next to :func:`~comera_rec.dlrm.scaling_counts.step_bytes`."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.scaling_counts import ModelComm, allreduce_payload, count_model, pooled_payload, step_bytes


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
