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

The counts and the network model are :mod:`comera_rec.dlrm.scaling_counts`, the gloo
measurement :mod:`comera_rec.dlrm.scaling_measure` (their names importable from here too);
this module makes the tables.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from comera_rec.dlrm.config import DLRMConfig

# re-exported: importable from here as before the split
from comera_rec.dlrm.scaling_counts import (  # noqa: F401
    FLOAT_BYTES,
    ID_BYTES,
    LENGTH_BYTES,
    ModelComm,
    Network,
    StepBytes,
    StepTime,
    allreduce_payload,
    allreduce_time,
    alltoall_time,
    comm_time,
    count_model,
    pooled_payload,
    step_bytes,
)
from comera_rec.dlrm.scaling_measure import demo_config, measure, measure_table  # noqa: F401


def count_config(config: DLRMConfig, name: str = "") -> ModelComm:
    """:func:`count_model` of the model ``config`` builds, on the meta device."""
    from comera_rec.dlrm.model import build_dlrm

    return count_model(build_dlrm(config, device="meta"), name)


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
