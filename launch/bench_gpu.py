"""Tensor core on one CUDA device: TTM lookups and TT layers against their dense baselines.

Needs only torch (and triton for the fused lookup): no TorchRec, so it runs on any CUDA
machine. Every comparison is timed interleaved in one process (CUDA events, medians);
peak device memory is measured per variant on its own (allocator statistics reset).

Lookups: the Kaggle tables that the DLRM config compresses (``min_params_to_compress``),
one id per table and sample, ids drawn ``floor(rows * u**3)`` (skewed, as Criteo ids
are). One training step = forward, backward, optimiser step:

* ``dense``: ``nn.EmbeddingBag(sparse=True)`` per table, ``torch.optim.Adagrad`` (sparse
  row updates). FBGEMM's CUDA TBE is the stronger baseline; use it where fbgemm-gpu is
  installed (``comera_rec.dlrm.bench_device``).
* ``tt_triton``: ``TTMEmbeddingBag`` at ``--rank``, the fused Triton lookup, Adagrad.
* ``tt_torch``: the same tables through the PyTorch path (Triton off), to credit the kernel.
* ``tt_static``: ``tt_triton`` with static shapes (no de-duplication, no host
  synchronisation), eager.
* ``tt_graphed``: ``tt_static`` with the whole step one CUDA graph.

Layers: ``TTLinear`` vs ``nn.Linear`` at the DLRM MLP shapes, forward and backward.

Scoring (``--score``, docs/serving.md): the same tables and layers forward only, without
gradients and inside ``cached_weights`` (as a scoring process runs: values derived from
the parameters are kept between batches), at serving batch sizes (1, 64, 512, 4096 rows):
``dense``, ``tt_triton``, ``tt_torch`` and ``tt_static`` eagerly, and ``dense_graphed`` /
``tt_graphed`` (the static lookup; the layers as they score) replayed as one CUDA graph
per call (nothing is kept inside a capture: the graph recomputes what eager calls keep).

    python launch/bench_gpu.py                 # Kaggle tables, batch 2048 and 8192
    python launch/bench_gpu.py --score         # scoring, batch 1, 64, 512 and 4096
    python launch/bench_gpu.py --quick         # small, a smoke run (CPU too)
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch
from torch import nn

from comera_rec.tensor import TTLinear, TTMEmbeddingBag, cached_weights, kernels, set_static_shapes
from comera_rec.training.cuda_graph import CudaGraphCapture, GraphedTrainStep
from comera_rec.utils.benchmark import time_interleaved
from comera_rec.utils.logs import quiet_profiler_banners, state_sparse_invariant_checks

EMBEDDING_DIM = 16
# The Kaggle tables DLRMConfig.kaggle() compresses (rows * 16 >= min_params_to_compress), in
# table order. Written out rather than imported: comera_rec.dlrm needs TorchRec, this script
# must not (tests/launch/test_bench_gpu.py checks the two agree).
KAGGLE_COMPRESSED_SIZES = [10131227, 2202608, 93145, 8351593, 5461306, 7046547, 286181, 142572]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved_device(
    variants: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int = 5
) -> dict[str, float]:
    """Median milliseconds per call of each variant, run in turn: :func:`time_interleaved`
    with a device synchronisation ending each call, so the GPU work is counted."""

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        return lambda: (fn(), _sync(device))

    seconds = time_interleaved({k: synced(fn) for k, fn in variants.items()}, repeats, warmup)
    return {k: v * 1e3 for k, v in seconds.items()}


class LookupModel(nn.Module):
    """One bag per table and sample, the pooled rows concatenated: ``(B, T * D)``."""

    def __init__(self, sizes: list[int], kind: str, rank: int) -> None:
        super().__init__()
        if kind == "dense":
            self.tables = nn.ModuleList(
                nn.EmbeddingBag(n, EMBEDDING_DIM, mode="sum", sparse=True, include_last_offset=True) for n in sizes
            )
        else:
            self.tables = nn.ModuleList(TTMEmbeddingBag(n, EMBEDDING_DIM, rank) for n in sizes)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # ids: (T, B), offsets: (B + 1,) shared by every table (one id per bag)
        return torch.cat([t(ids[i], offsets) for i, t in enumerate(self.tables)], dim=1)


def lookup_batch(sizes: list[int], batch: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([(n * torch.rand(batch, generator=g) ** 3).long().clamp_(max=n - 1) for n in sizes])
    grad = torch.randn(batch, len(sizes) * EMBEDDING_DIM, generator=g)
    return {"ids": ids.to(device), "offsets": torch.arange(batch + 1).to(device), "grad": grad.to(device)}


def lookup_step(model: LookupModel, opt: torch.optim.Optimizer) -> Callable[[dict], torch.Tensor]:
    def step(b: dict) -> torch.Tensor:
        out = model(b["ids"], b["offsets"])
        loss = (out * b["grad"]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


def _without_triton(fn: Callable[[dict], torch.Tensor]) -> Callable[[dict], torch.Tensor]:
    """``fn`` run with the fused Triton lookup off (the PyTorch path), to credit the kernel."""

    def run(b: dict) -> torch.Tensor:
        kernels.set_triton_enabled(False)
        try:
            return fn(b)
        finally:
            kernels.set_triton_enabled(True)

    return run


def build_lookup(kind: str, sizes: list[int], rank: int, device: torch.device):
    torch.manual_seed(0)
    model = LookupModel(sizes, "dense" if kind == "dense" else "tt", rank).to(device)
    graphed = kind == "tt_graphed"
    if kind in ("tt_static", "tt_graphed"):
        set_static_shapes(model)
    if kind == "dense":
        state_sparse_invariant_checks()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01, **({} if kind == "dense" else {"foreach": True}))
    step = lookup_step(model, opt)
    if kind == "tt_torch":
        return model, _without_triton(step)
    if graphed:
        return model, GraphedTrainStep(step, capture=CudaGraphCapture(device))
    return model, step


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_lookups(sizes: list[int], batches: list[int], rank: int, device: torch.device, repeats: int) -> None:
    kinds = ["dense", "tt_triton", "tt_torch", "tt_static"] + (["tt_graphed"] if device.type == "cuda" else [])
    if not kernels.triton_available() or device.type != "cuda":
        kinds.remove("tt_triton")
    for batch in batches:
        data = lookup_batch(sizes, batch, device, seed=batch)
        built = {k: build_lookup(k, sizes, rank, device) for k in kinds}
        ms = time_interleaved_device({k: (lambda f=f: f(data)) for k, (_, f) in built.items()}, device, repeats)
        peaks = {}
        del built
        for k in kinds:  # peak memory of each variant alone
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            model, f = build_lookup(k, sizes, rank, device)
            for _ in range(3):
                f(data)
            _sync(device)
            peaks[k] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None, param_bytes(model))
            del model, f
        for k in kinds:
            row = {
                "bench": "lookup_step",
                "variant": k,
                "batch": batch,
                "tables": len(sizes),
                "rank": rank,
                "ms": round(ms[k], 3),
                "vs_dense": round(ms["dense"] / ms[k], 3),
                "peak_bytes": peaks[k][0],
                "param_bytes": peaks[k][1],
            }
            print(json.dumps(row), flush=True)


def bench_linear(shapes: list[tuple[int, int]], batches: list[int], rank: int, device: torch.device, repeats: int):
    for batch in batches:
        for n_in, n_out in shapes:
            torch.manual_seed(0)
            layers = {"dense": nn.Linear(n_in, n_out).to(device), "tt": TTLinear(n_in, n_out, rank).to(device)}
            x = torch.randn(batch, n_in, device=device, requires_grad=True)
            grad = torch.randn(batch, n_out, device=device)

            def step(layer: nn.Module) -> None:
                layer.zero_grad(set_to_none=True)
                layer(x).backward(grad)

            ms = time_interleaved_device({k: (lambda m=m: step(m)) for k, m in layers.items()}, device, repeats)
            for k in layers:
                row = {"bench": "linear_fwd_bwd", "variant": k, "batch": batch, "shape": [n_in, n_out], "rank": rank}
                row.update(ms=round(ms[k], 4), vs_dense=round(ms["dense"] / ms[k], 3))
                row["param_bytes"] = param_bytes(layers[k])
                print(json.dumps(row), flush=True)


def _scorer(fn: Callable[[dict], torch.Tensor], graphed: bool, device: torch.device) -> Callable[[dict], object]:
    """``fn`` without gradients; with ``graphed``, warmed up, captured once and replayed per call."""

    def score(b: dict) -> torch.Tensor:
        with torch.no_grad():
            return fn(b)

    return GraphedTrainStep(score, capture=CudaGraphCapture(device), name="scoring") if graphed else score


def bench_lookup_scoring(sizes: list[int], batches: list[int], rank: int, device: torch.device, repeats: int) -> None:
    """Forward-only lookups of every table: ``(B, T * D)`` pooled rows per call."""
    cuda = device.type == "cuda"
    kinds = ["dense", "tt_triton", "tt_torch", "tt_static"] + (["dense_graphed", "tt_graphed"] if cuda else [])
    if not kernels.triton_available() or not cuda:
        kinds.remove("tt_triton")
    torch.manual_seed(0)
    dense = LookupModel(sizes, "dense", rank).to(device).eval()
    tt = LookupModel(sizes, "tt", rank).to(device).eval()
    tt_static = LookupModel(sizes, "tt", rank).to(device).eval()
    tt_static.load_state_dict(tt.state_dict())
    set_static_shapes(tt_static)

    def lookup(model: LookupModel) -> Callable[[dict], torch.Tensor]:
        return lambda b: model(b["ids"], b["offsets"])

    fns = {
        "dense": lookup(dense),
        "tt_triton": lookup(tt),
        "tt_torch": _without_triton(lookup(tt)),
        "tt_static": lookup(tt_static),
        "dense_graphed": lookup(dense),
        "tt_graphed": lookup(tt_static),
    }
    for batch in batches:
        data = lookup_batch(sizes, batch, device, seed=batch)
        scorers = {k: _scorer(fns[k], k.endswith("_graphed"), device) for k in kinds}
        with cached_weights():  # as a scoring process runs (values kept between batches)
            outs = {k: scorers[k](data).clone() for k in kinds}
            ms = time_interleaved_device({k: (lambda f=f: f(data)) for k, f in scorers.items()}, device, repeats)
        # every TT variant scores the same rows (the dense tables are other weights)
        ref = outs.get("tt_torch")
        errors = {k: float((o - ref).abs().max()) for k, o in outs.items() if k.startswith("tt_")}
        for k in kinds:
            row = {"bench": "lookup_score", "variant": k, "batch": batch, "tables": len(sizes), "rank": rank}
            row.update(ms=round(ms[k], 4), vs_dense=round(ms["dense"] / ms[k], 3))
            row["rows_per_s"] = round(batch / ms[k] * 1e3)
            row["max_abs_diff_vs_tt_torch"] = errors.get(k)
            print(json.dumps(row), flush=True)


def bench_linear_scoring(
    shapes: list[tuple[int, int]], batches: list[int], rank: int, device: torch.device, repeats: int
) -> None:
    """Forward-only layers (dense and TT, eager and, on CUDA, graphed) at serving batch sizes."""
    graphs = [False, True] if device.type == "cuda" else [False]
    for batch in batches:
        for n_in, n_out in shapes:
            torch.manual_seed(0)
            layers = {"dense": nn.Linear(n_in, n_out).to(device), "tt": TTLinear(n_in, n_out, rank).to(device)}
            data = {"x": torch.randn(batch, n_in, device=device)}
            scorers = {
                f"{k}_graphed" if g else k: _scorer(lambda b, m=m: m(b["x"]), g, device)
                for k, m in layers.items()
                for g in graphs
            }
            with cached_weights():
                ms = time_interleaved_device({k: (lambda f=f: f(data)) for k, f in scorers.items()}, device, repeats)
            for k in scorers:
                row = {"bench": "linear_score", "variant": k, "batch": batch, "shape": [n_in, n_out], "rank": rank}
                row.update(ms=round(ms[k], 4), vs_dense=round(ms["dense"] / ms[k], 3))
                print(json.dumps(row), flush=True)


def profile_lookup(
    kind: str, sizes: list[int], batch: int, rank: int, device: torch.device, steps: int = 5, score: bool = False
) -> None:
    """Print where one variant's lookup step (or, with ``score``, its scoring call inside
    ``cached_weights``) spends its time (torch.profiler, top operators)."""
    from torch.profiler import ProfilerActivity, profile

    data = lookup_batch(sizes, batch, device, seed=batch)
    model, f = build_lookup(kind, sizes, rank, device)
    if score:
        model.eval()

        def f(b: dict) -> torch.Tensor:
            with torch.no_grad():
                return model(b["ids"], b["offsets"])

    with cached_weights():
        for _ in range(3):
            f(data)
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with quiet_profiler_banners(), profile(activities=activities) as prof:
            for _ in range(steps):
                f(data)
            _sync(device)
    print(f"profile of {kind}{' scoring' if score else ''}, batch {batch}, {steps} calls:", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="three small tables, small batches (a smoke run)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["lookup", "linear"])
    parser.add_argument("--profile", nargs="*", default=[], help="lookup variants to profile after the timings")
    parser.add_argument("--score", action="store_true", help="forward only, without gradients (serving)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        sizes, batches, repeats, rank = [5000, 3000, 20_000], [1, 64] if args.score else [64], 3, 4
        shapes = [(64, 32)]
    else:
        sizes = list(KAGGLE_COMPRESSED_SIZES)
        batches, repeats, rank = args.batches, args.repeats, args.rank
        if args.score and batches == parser.get_default("batches"):
            batches = [1, 64, 512, 4096]
        shapes = [(13, 512), (512, 256), (256, 64), (512, 256)]  # bottom MLP; (512, 256) again for the top
        shapes = list(dict.fromkeys(shapes))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "torch": torch.__version__, "triton": kernels.triton_available()}), flush=True)
    if "lookup" not in args.skip:
        (bench_lookup_scoring if args.score else bench_lookups)(sizes, batches, rank, device, repeats)
    if "linear" not in args.skip:
        (bench_linear_scoring if args.score else bench_linear)(shapes, batches, rank, device, repeats)
    for kind in args.profile:
        profile_lookup(kind, sizes, batches[0], rank, device, score=args.score)


if __name__ == "__main__":
    main()
