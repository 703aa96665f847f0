"""DLRM benchmark: compressed vs dense TorchRec DLRM at Criteo Kaggle shapes, side by side.

Baseline: TorchRec's DLRM with FBGEMM's fused table-batched embedding (row-wise Adagrad
fused into backward) and dense MLPs. Compressed: TTM tables for the large tables and TT
MLP layers, at the starting rank and again with every rank cut to about half. All
variants train on the same synthetic Kaggle-shaped batches (Zipf ids). Step time, peak
RSS and page faults are measured with each variant alone in fresh processes, as it
would train, the variants alternating over several rounds; validation AUC after the same
number of steps, all variants trained in one process (whose interleaved step times are
printed too: sharing a process changes them, see docs/performance.md).

The installed console script ``comera-bench``; from a checkout ``python launch/bench_dlrm.py``
(the same :func:`main`).

    comera-bench                  # Kaggle shapes, batch 2048
    comera-bench --mlperf         # MLPerf DLRM-DCNv2 shapes, compressed only
    comera-bench --quick          # a smoke run
    comera-bench --parts          # where the step goes, per part
    comera-bench --no-fused-interaction  # TorchRec's InteractionArch and SparseArch in the
                                         # compressed models, and no dense_fi (by default the
                                         # compressed models have PairwiseDotInteraction and
                                         # FlatSparseArch, and dense_fi, the dense model with
                                         # them, credits what they, the fused row-wise
                                         # Adagrad lookup and the fused narrow first layer
                                         # give a dense model)
    comera-bench --rounds 5       # more fresh processes per variant for the step time
    comera-bench --lookup-paths   # adds tt_torch / tt_half_torch: the same models with the
                                  # fused CPU kernels off (TTM lookup, TT linear, interaction)
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.model import build_dlrm_train
from comera_rec.integration.distributed import EmbeddingOptimizerSpec, replicated_parameter_groups, wrap_model
from comera_rec.rank import model_num_parameters
from comera_rec.tensor import kernels
from comera_rec.tensor.train import tensor_train_modules
from comera_rec.training.metrics import BinaryMetrics
from comera_rec.utils.benchmark import current_rss_bytes, fmt_bytes, peak_rss_bytes, time_interleaved
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory, minor_page_faults
from comera_rec.utils.logs import quiet_foreign_notices


@dataclass
class Setup:
    batch_size: int = 2048
    train_steps: int = 300
    val_rows: int = 65536
    zipf: float = 1.1
    rank: int = 32
    warmup_steps: int = 20  # per process (the first ~20 steps of a process run slow), before the timed steps
    timed_steps: int = 30  # per process: its median step time is the process's figure
    rounds: int = 3  # fresh processes per variant, the variants alternating
    keep_freed_memory: bool = True  # glibc malloc reuses freed activations (trainer.keep_freed_memory)
    fused_interaction: bool = (
        True  # PairwiseDotInteraction + FlatSparseArch (+ NarrowLinear) in the compressed models and in dense_fi
    )
    lookup_paths: bool = False  # also the compressed models with the CPU kernels off (tt_torch, tt_half_torch)


VARIANTS = ("dense", "tt", "tt_half")
# the dense model with the parts a dense model shares (not with --no-fused-interaction): PairwiseDotInteraction,
# FlatSparseArch and through it the fused CPU row-wise Adagrad lookup for all its tables
DENSE_FUSED = "dense_fi"


TORCH_LOOKUP = "_torch"  # suffix: the same compressed model with the fused CPU kernels off (PyTorch path)


def variants(setup: Setup) -> tuple[str, ...]:
    names = ("dense", DENSE_FUSED, "tt", "tt_half") if setup.fused_interaction else VARIANTS
    return names + (("tt" + TORCH_LOOKUP, "tt_half" + TORCH_LOOKUP) if setup.lookup_paths else ())


def use_lookup_path(variant: str) -> None:
    """The fused CPU kernels (TTM lookup, TT linear, interaction, input checks) for every variant
    but the ``_torch`` ones (process-wide switch)."""
    kernels.set_cpu_kernel_enabled(not variant.endswith(TORCH_LOOKUP))


def model_config(variant: str, setup: Setup, mlperf: bool) -> DLRMConfig:
    variant = variant.removesuffix(TORCH_LOOKUP)
    base = DLRMConfig.mlperf_dcn() if mlperf else DLRMConfig.kaggle()
    # TorchRec's interaction for "dense" always: it is the baseline as TorchRec ships it
    fused = setup.fused_interaction and variant != "dense" and not mlperf
    return replace(
        base, compressed=not variant.startswith("dense"), rank=setup.rank, mlp_rank=setup.rank, fused_interaction=fused
    )


@torch.no_grad()
def cut_ranks_to_half(model: nn.Module) -> None:
    """Zero the controllers of the upper half of every bond, then truncate for real."""
    for _, module in tensor_train_modules(model):
        for d in module.controllers:
            r = d.shape[-1]
            d[..., (r + 1) // 2 :] = 0.0
        module.truncate_ranks(1e-6)


def build(variant: str, setup: Setup, mlperf: bool):
    torch.manual_seed(0)
    model = build_dlrm_train(model_config(variant, setup, mlperf), device="cpu")
    if variant.removesuffix(TORCH_LOOKUP) == "tt_half":
        cut_ranks_to_half(model)
    wrapped, _ = wrap_model(
        model,
        device="cpu",
        embedding_optimizer=EmbeddingOptimizerSpec(RowWiseAdagrad, {"lr": EMBEDDING_LR, "eps": 1e-8}),
    )
    return wrapped, adamw(replicated_parameter_groups(wrapped))


# The demo config's learning rates, the same for every variant.
LEARNING_RATES = {"cores": 3e-3, "controllers": 1e-2, "other": 1e-3}
EMBEDDING_LR = 0.05


def adamw(groups: dict[str, list[nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": groups[k], "lr": LEARNING_RATES[k]} for k in LEARNING_RATES if groups[k]],
        weight_decay=0.0,
        fused=True,  # torch's fused AdamW, for every variant alike
    )


def batches(setup: Setup, mlperf: bool, stream: str, rows: int):
    sizes = list(model_config("dense", setup, mlperf).table_sizes)
    cfg = SyntheticCriteoConfig(
        num_embeddings_per_feature=sizes,
        zipf_exponent=setup.zipf,
        batch_size=setup.batch_size,
        num_rows=rows,
        seed=0,
        stream=stream,
        drop_last=True,
    )
    return SyntheticCriteo(cfg)


def train_batches(setup: Setup, mlperf: bool, n: int) -> list:
    """``n`` distinct training batches, one per timed step. Not a few batches cycled: a dense
    model trained over and over on four batches fits them within ~40 steps, its gradients
    become denormal floats and its MLPs' GEMMs slow down several-fold (docs/performance.md)."""
    return list(itertools.islice(iter(batches(setup, mlperf, "train", setup.batch_size * n)), n))


def train_step(wrapped, optimizer, batch) -> float:
    loss, _ = wrapped(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


@torch.no_grad()
def auc(wrapped, setup: Setup, mlperf: bool) -> float:
    metrics = BinaryMetrics(torch.device("cpu"))
    wrapped.eval()
    for batch in batches(setup, mlperf, "val", setup.val_rows):
        _, (_, logits, labels) = wrapped(batch)
        metrics.update(logits, labels)
    wrapped.train()
    return metrics.compute()["auc"]


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------------------ own processes


def process_child(variant: str, setup: Setup, mlperf: bool, queue) -> None:  # runs in a fresh process
    """Build one variant and train it alone, as a training process would: peak RSS, the
    median step time after a warm-up, and minor page faults per step."""
    quiet_foreign_notices()
    if setup.keep_freed_memory:
        keep_freed_memory()
    use_lookup_path(variant)
    data = train_batches(setup, mlperf, setup.warmup_steps + setup.timed_steps)
    base = current_rss_bytes()
    wrapped, optimizer = build(variant, setup, mlperf)
    freeze_live_objects()  # as the trainer does (trainer.freeze_gc), every variant alike
    times = []
    faults_at_start = minor_page_faults()  # read again when the timed steps begin
    for step in range(setup.warmup_steps + setup.timed_steps):
        if step == setup.warmup_steps:
            faults_at_start = minor_page_faults()
        start = time.perf_counter()
        train_step(wrapped, optimizer, data[step % len(data)])
        times.append(time.perf_counter() - start)
    faults = (minor_page_faults() - faults_at_start) / setup.timed_steps
    queue.put(
        {
            "base": base,
            "peak": peak_rss_bytes(),
            "step_s": statistics.median_high(times[setup.warmup_steps :]),
            "faults": faults,
        }
    )
    queue.close()
    queue.join_thread()  # the result is in the pipe
    _exit_now()


def _exit_now() -> None:
    """Leave without the interpreter's teardown. Triton (which torch imports for TorchRec)
    prints a hundred lines of nanobind leak warnings at a normal exit, in every process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_process(variant: str, setup: Setup, mlperf: bool) -> dict:
    """:func:`process_child` in a fresh (spawned) process; its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=process_child, args=(variant, setup, mlperf, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def own_process_rounds(names: tuple[str, ...], setup: Setup, mlperf: bool) -> dict[str, dict]:
    """Each variant in its own fresh process, ``setup.rounds`` times, the variants
    alternating (A, B, C, A, B, C, ...) so that the machine's drift hits all alike.

    Returns, per variant: the median over rounds of the per-process median step time, of
    the page faults per step, and the largest peak RSS.
    """
    runs: dict[str, list[dict]] = {v: [] for v in names}
    for _ in range(setup.rounds):
        for v in names:
            runs[v].append(run_in_process(v, setup, mlperf))
    median = statistics.median_high
    return {
        v: {
            "step_s": median([r["step_s"] for r in rs]),
            "faults": median([r["faults"] for r in rs]),
            "peak": max(r["peak"] for r in rs),
            "base": rs[0]["base"],
            "steps": [r["step_s"] for r in rs],
        }
        for v, rs in runs.items()
    }


# ------------------------------------------------------------------------------ parts


def _dlrm(wrapped: nn.Module) -> nn.Module:
    """TorchRec's ``DLRM`` inside ``DLRMTrain`` (single process: not wrapped further)."""
    return getattr(wrapped, "module", wrapped).model


def part_times(wrapped: nn.Module, batch, count_flops: bool = False) -> dict[str, float]:
    """Seconds (or, with ``count_flops``, matrix-multiply FLOPs) of forward + backward of
    each part of one step, run one after the other on the batch (the sparse arch includes
    the fused table update in its backward)."""
    dlrm, state, out = _dlrm(wrapped), {}, {}

    def lookups() -> None:
        emb = dlrm.sparse_arch(batch.sparse_features)  # (B, F, D)
        emb.backward(torch.ones_like(emb))
        state["emb"] = emb.detach().requires_grad_()

    def bottom() -> None:
        dense = dlrm.dense_arch(batch.dense_features)  # (B, D)
        dense.backward(torch.ones_like(dense))
        state["dense"] = dense.detach().requires_grad_()

    def interaction() -> None:
        inter = dlrm.inter_arch(dense_features=state["dense"], sparse_features=state["emb"])  # (B, D + F(F+1)/2)
        inter.backward(torch.ones_like(inter))
        state["inter"] = inter.detach().requires_grad_()

    def top() -> None:
        logits = dlrm.over_arch(state["inter"])
        logits.backward(torch.ones_like(logits))

    for name, run in (("lookups", lookups), ("bottom MLP", bottom), ("interaction", interaction), ("top MLP", top)):
        if count_flops:
            with FlopCounterMode(display=False) as counter:
                run()
            out[name] = float(counter.get_total_flops())
        else:
            t = time.perf_counter()
            run()
            out[name] = time.perf_counter() - t
    wrapped.zero_grad(set_to_none=True)
    return out


def sgemm_flops_per_second(n: int = 2048, repeats: int = 10) -> float:
    """This machine's matrix throughput: the median of ``repeats`` ``n^3`` float32 GEMMs."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / time_interleaved({"sgemm": lambda: a @ b}, repeats=repeats, warmup=1)["sgemm"]


def parts(setup: Setup, repeats: int = 20) -> None:
    """Where the step goes: each part's forward + backward, variants interleaved; then each
    part's matrix-multiply FLOPs against the time a 2048^3 sgemm's throughput allows."""
    if setup.keep_freed_memory:
        keep_freed_memory()
    names_ = variants(setup)
    models = {v: build(v, setup, mlperf=False) for v in names_}
    data = train_batches(setup, False, repeats + 2)
    freeze_live_objects()
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in names_}
    for i in range(repeats + 2):
        for v in names_:
            use_lookup_path(v)
            times = part_times(models[v][0], data[i % len(data)])
            t = time.perf_counter()
            train_step(*models[v], data[i % len(data)])
            times["whole step"] = time.perf_counter() - t
            if i >= 2:  # warm-up
                for k, sec in times.items():
                    samples[v].setdefault(k, []).append(sec)
    names = list(samples["dense"])
    median = {v: {n: statistics.median_high(samples[v][n]) for n in names} for v in names_}
    print(f"forward + backward per part, median of {repeats} interleaved rounds (ms), batch {setup.batch_size}")
    print(f"{'variant':14s}" + "".join(f"{n:>13s}" for n in names))
    for v in names_:
        print(f"{v:14s}" + "".join(f"{median[v][n] * 1e3:13.1f}" for n in names))

    rate = sgemm_flops_per_second()
    flops = {}
    for v in names_:
        # counted on the PyTorch path: the counter sees ATen ops only, not inside the C++
        # kernels, and the kernels do the same products
        kernels.set_cpu_kernel_enabled(False)
        flops[v] = part_times(models[v][0], data[0], count_flops=True)
    kernels.set_cpu_kernel_enabled(True)
    print(
        f"\nmatrix-multiply FLOPs per part (forward + backward, torch.utils.flop_counter, counted on the "
        f"PyTorch path; lookups: the TTM contractions only, FBGEMM's row reads count 0) against a 2048^3 "
        f"sgemm at {rate / 1e9:.0f} GFLOP/s:"
        f"\nGFLOP / time those FLOPs need at that rate (ms) / measured time over it"
    )
    print(f"{'variant':14s}" + "".join(f"{n:>22s}" for n in names[:-1]))
    for v in names_:
        cells = []
        for n in names[:-1]:
            ideal = flops[v][n] / rate
            over = f"{median[v][n] / ideal:6.1f}x" if ideal > 0 else "      -"
            cells.append(f"{flops[v][n] / 1e9:7.3f} / {ideal * 1e3:5.2f} / {over}")
        print(f"{v:14s}" + "".join(f"{c:>22s}" for c in cells))


# ------------------------------------------------------------------------------ main


def kaggle(setup: Setup) -> None:
    print(
        f"Criteo Kaggle shapes, batch {setup.batch_size}, Zipf({setup.zipf}) ids, rank {setup.rank}; "
        f"{torch.get_num_threads()} threads; malloc keeps freed memory: {setup.keep_freed_memory} "
        f"(every variant alike)"
    )
    names = variants(setup)
    # Step time, peak RSS and page faults: each variant alone in fresh processes, as it would train.
    alone = own_process_rounds(names, setup, mlperf=False)

    # AUC after equal steps: all variants in this process on the same batches (their
    # interleaved step times are printed too, for comparison with the figures above).
    if setup.keep_freed_memory:
        keep_freed_memory()
    models = {v: build(v, setup, mlperf=False) for v in names}
    freeze_live_objects()
    params = {
        v: model_num_parameters(m[0]) if not v.startswith("dense") else sum(p.numel() for p in m[0].parameters())
        for v, m in models.items()
    }
    sizes = {v: model_bytes(m[0]) for v, m in models.items()}
    times: dict[str, list[float]] = {v: [] for v in names}
    stream = iter(batches(Setup(**{**setup.__dict__}), False, "train", setup.batch_size * setup.train_steps))
    for step in range(setup.train_steps):
        batch = next(stream)
        for v in names:  # interleaved: every variant sees the machine in the same state
            use_lookup_path(v)
            t0 = time.perf_counter()
            train_step(*models[v], batch)
            times[v].append(time.perf_counter() - t0)
    shared = {v: statistics.median_high(t[3:]) for v, t in times.items()}
    aucs = {}
    for v in names:
        use_lookup_path(v)
        aucs[v] = auc(models[v][0], setup, False)
    del models

    step = {v: alone[v]["step_s"] for v in names}
    fused = DENSE_FUSED in names  # then also the speed-up over the dense model with the same interaction
    print(
        f"\n{'variant':14s} {'step ms':>9s} {'speed-up':>9s}"
        + (f" {'vs ' + DENSE_FUSED:>12s}" if fused else "")
        + f" {'samples/s':>10s} {'params':>13s} "
        f"{'model bytes':>12s} {'smaller':>8s} {'peak RSS':>10s} {'RSS ratio':>9s} {'faults/step':>11s} "
        f"{'val AUC':>8s}"
    )
    for v in names:
        peak = alone[v]["peak"]
        versus = f" {step[DENSE_FUSED] / step[v]:11.2f}x" if fused else ""
        print(
            f"{v:14s} {step[v] * 1e3:9.2f} {step['dense'] / step[v]:8.2f}x{versus} "
            f"{setup.batch_size / step[v]:10.0f} {params[v]:13,d} {fmt_bytes(sizes[v]):>12s} "
            f"{sizes['dense'] / sizes[v]:7.0f}x {fmt_bytes(peak):>10s} {alone['dense']['peak'] / peak:8.1f}x "
            f"{alone[v]['faults']:11.0f} {aucs[v]:8.4f}"
        )
    print(
        f"\nstep: median over {setup.rounds} fresh processes per variant (variants alternating) of each "
        f"process's median of {setup.timed_steps} steps after {setup.warmup_steps} warm-up steps (AdamW on "
        f"MLPs/cores, fused row-wise Adagrad on dense tables); per-process medians (ms): "
        + "; ".join(f"{v} " + " ".join(f"{t * 1e3:.1f}" for t in alone[v]["steps"]) for v in names)
    )
    print(
        f"peak RSS: the largest of those processes (imports included: {fmt_bytes(alone['dense']['base'])} "
        f"before the model); AUC on {setup.val_rows} synthetic validation rows after {setup.train_steps} steps"
    )
    print(
        "all variants in one process, steps interleaved (median of "
        f"{setup.train_steps - 3}): "
        + ", ".join(f"{v} {shared[v] * 1e3:.1f} ms ({shared['dense'] / shared[v]:.2f}x)" for v in names)
    )


def mlperf(setup: Setup) -> None:
    print(f"MLPerf DLRM-DCNv2 shapes (204M rows, dim 128), compressed at rank {setup.rank}, batch {setup.batch_size}")
    result = run_in_process("tt", setup, mlperf=True)
    print(
        f"  step {result['step_s'] * 1e3:.1f} ms, {setup.batch_size / result['step_s']:.0f} samples/s, "
        f"peak RSS {fmt_bytes(result['peak'])} (before the model: {fmt_bytes(result['base'])})"
    )
    dense_bytes = sum(model_config("dense", setup, True).table_sizes) * 128 * 4
    print(f"  dense tables alone would need {fmt_bytes(dense_bytes)}")


def main(argv: list[str] | None = None) -> None:
    """The benchmark's command line (``argv``, ``None``: ``sys.argv[1:]``); leaves the process at the end."""
    quiet_foreign_notices()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlperf", action="store_true", help="MLPerf DLRM-DCNv2 shapes, compressed only")
    parser.add_argument("--parts", action="store_true", help="time each part of the step (lookups, MLPs, interaction)")
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke run")
    parser.add_argument("--steps", type=int, default=None, help="training steps per variant")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument(
        "--fused-interaction",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="PairwiseDotInteraction and FlatSparseArch in the compressed models, and dense_fi, the "
        "dense model with them (and so with the fused row-wise Adagrad lookup); default on",
    )
    parser.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="leave glibc malloc as it is (it may return freed activations to the kernel and "
        "page-fault them in again); the default keeps them, as the trainer does",
    )
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per variant for the step time")
    parser.add_argument(
        "--lookup-paths",
        action="store_true",
        help="also time the compressed models with the fused CPU kernels off (tt_torch, tt_half_torch)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    setup = Setup(
        batch_size=args.batch_size,
        rank=args.rank,
        keep_freed_memory=args.keep_freed_memory,
        fused_interaction=args.fused_interaction,
        rounds=args.rounds,
        lookup_paths=args.lookup_paths,
    )
    print(f"host: {kernels.host_description()}; torch {torch.__version__}", flush=True)  # where figures come from
    if args.quick:
        setup = replace(setup, train_steps=10, val_rows=8192, warmup_steps=1, timed_steps=3, rounds=1)
    if args.steps:
        setup = replace(setup, train_steps=args.steps)
    if args.parts:
        parts(setup)
    else:
        mlperf(setup) if args.mlperf else kaggle(setup)
    _exit_now()


if __name__ == "__main__":
    main()
