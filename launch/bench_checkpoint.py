"""How long a checkpoint holds training: a blocking save against a background one.

The state is a dense table of ``--megabytes`` with a row-wise accumulator beside it (what a
dense DLRM checkpoint is made of) plus small counters. Blocking: the whole
``save_checkpoint`` (files, fsync, checksums, rename). Background: the time until
``save_checkpoint_async`` returns (the NaN / inf check and a CPU copy), then, separately,
until its thread has finished. Rounds alternate the two; medians are printed.

    python launch/bench_checkpoint.py                  # 1024 MB
    python launch/bench_checkpoint.py --megabytes 64   # a smoke run
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from comera_rec.tensor import kernels
from comera_rec.training.async_save import Staging, save_checkpoint_async
from comera_rec.training.checkpoint import save_checkpoint


def make_state(megabytes: int, dim: int = 128) -> dict:
    rows = max(1, megabytes * 2**20 // (4 * dim))
    g = torch.Generator().manual_seed(0)
    table = torch.randn(rows, dim, generator=g)
    return {"model": {"table.weight": table}, "optim": {"table.momentum": torch.rand(rows, generator=g)}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    print(f"host: {kernels.host_description()}; torch {torch.__version__}", flush=True)
    shared = make_state(args.megabytes)
    nbytes = sum(t.numel() * t.element_size() for part in shared.values() for t in part.values())
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    blocking, stall, background = [], [], []
    staging = Staging()  # as the trainer keeps one: the first round copies into fresh memory
    try:
        for i in range(args.rounds):
            start = time.perf_counter()
            save_checkpoint(base / "blocking", i, {"step": i}, {}, keep=1, shared=shared)
            blocking.append(time.perf_counter() - start)
            start = time.perf_counter()
            pending = save_checkpoint_async(
                base / "background", i, {"step": i}, {}, keep=1, shared=shared, staging=staging
            )
            stall.append(time.perf_counter() - start)
            pending.wait()
            background.append(time.perf_counter() - start)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    b, s, w = (statistics.median(x) for x in (blocking, stall, background))
    print(f"state {nbytes / 2**20:.0f} MiB, medians of {args.rounds} rounds:")
    print(f"  blocking save holds training   {b:7.3f} s")
    print(f"  background save holds training {s:7.3f} s  ({b / s:.1f}x less; written in {w:.3f} s)")


if __name__ == "__main__":
    main()
