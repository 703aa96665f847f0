"""Step time of compressed vs dense TorchRec DLRM on one device (the GPU check's benchmark).

``dlrm/bench.py`` measures on CPU only (its models, batches and timers are CPU ones). This
is the device-agnostic short version :mod:`comera_rec.gpu_check` runs on a CUDA machine:
Kaggle shapes, one process, the dense tables as FBGEMM table-batched kernels with row-wise
Adagrad fused into backward (``wrap_model`` without a process group; on CUDA FBGEMM's CUDA
TBE), TT tables and layers at ``--rank``, AdamW for the rest, synthetic Kaggle-shaped batches.
Prints one JSON line per variant: median step milliseconds, samples/s, peak device memory.

    python -m comera_rec.dlrm.bench_device --device cuda            # Kaggle shapes, batch 2048
    python -m comera_rec.dlrm.bench_device --device cpu --tiny      # a smoke run (tests)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import replace

import torch

from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.model import build_dlrm_train
from comera_rec.integration.distributed import EmbeddingOptimizerSpec, replicated_parameter_groups, wrap_model

TINY = dict(
    table_sizes=[5000, 200] + [30] * 24, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], min_params_to_compress=0
)


def config(variant: str, rank: int, tiny: bool) -> DLRMConfig:
    base = DLRMConfig.kaggle(**TINY) if tiny else DLRMConfig.kaggle()
    return replace(base, compressed=variant == "tt", rank=rank, mlp_rank=rank, validate_inputs=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(variant: str, device: torch.device, batch_size: int, steps: int, warmup: int, rank: int, tiny: bool):
    """Median step seconds of ``variant`` (``"dense"`` or ``"tt"``) over ``steps`` after ``warmup``."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    cfg = config(variant, rank, tiny)
    model = build_dlrm_train(cfg, device="meta")
    wrapped, _ = wrap_model(
        model, device=device, embedding_optimizer=EmbeddingOptimizerSpec(RowWiseAdagrad, {"lr": 0.05, "eps": 1e-8})
    )
    optim = torch.optim.AdamW([p for ps in replicated_parameter_groups(wrapped).values() for p in ps], lr=1e-3)
    data = SyntheticCriteo(
        SyntheticCriteoConfig(
            num_embeddings_per_feature=list(cfg.table_sizes),
            batch_size=batch_size,
            num_rows=batch_size * (steps + warmup),
            seed=0,
            stream="train",
            drop_last=True,
        )
    )
    batches = [b.to(device) for b in itertools.islice(iter(data), steps + warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i, batch in enumerate(batches):
        _sync(device)
        start = time.perf_counter()
        loss, _ = wrapped(batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    step = statistics.median(times)
    return {
        "variant": variant,
        "device": str(device),
        "batch_size": batch_size,
        "steps": steps,
        "step_ms": round(step * 1e3, 3),
        "samples_per_s": round(batch_size / step),
        "peak_device_bytes": peak,
        "loss": round(float(loss.detach()), 5),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=["dense", "tt"], choices=["dense", "tt"])
    parser.add_argument("--tiny", action="store_true", help="tiny tables (a smoke run, not Kaggle shapes)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for variant in args.variants:
        result = run_variant(variant, device, args.batch_size, args.steps, args.warmup, args.rank, args.tiny)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
