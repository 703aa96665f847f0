"""Serving benchmark: compressed vs dense TorchRec DLRM scoring rows, eager and exported.

Four variants at Criteo Kaggle shapes (``--quick``: tiny shapes, a smoke run):

* ``dense_eager``: TorchRec's ``DLRM`` (``EmbeddingBagCollection``, TorchRec's interaction),
  loaded from its saved state dict, called on ``(dense, KeyedJaggedTensor)``: the baseline.
* ``dense_export``: its inference form (:mod:`comera_rec.dlrm.export`) exported, loaded with
  ``torch.export.load`` in an interpreter that imports torch only (no TorchRec, no
  comera-rec), as a server of the program would run it.
* ``tt_eager``: the compressed model (TTM tables, TT layers, fused interaction, rank 32)
  as the trainer builds it, loaded from its saved state dict (fused CPU kernels on).
* ``tt_export``: its exported inference form, run as ``dense_export``.

One process builds both models (seed 0; the figures do not depend on trained values) and
saves, per model, the eager state dict (``torch.save``) and the exported program
(``torch.export.save``), and the input batches (Zipf ids, as in ``comera_rec.dlrm.bench``; a
few distinct batches per size, cycled). Then each variant runs alone in a fresh process, as
a server would: it reads the inputs, loads its model file (the load time), scores every
batch size under ``torch.inference_mode`` and reports rows/s, p50 / p99 latency per batch
and its peak RSS (``ru_maxrss``: imports, inputs and model). The same rows per CPU second
and p50 CPU time per batch (``time.process_time``) say how much work a batch is where
other processes share the host (wall times then include waits for a core). Ratios are
against ``dense_eager`` from the same run.

    python launch/bench_serving.py                      # Kaggle shapes, batches 1, 64, 512, 4096
    python launch/bench_serving.py --batches 1 4096 --iters 30   # a shorter run
    python launch/bench_serving.py --quick              # tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.export import export_dlrm, kjt_inputs, save_exported, serving_model
from comera_rec.dlrm.model import build_dlrm
from comera_rec.utils.benchmark import current_rss_bytes, fmt_bytes, peak_rss_bytes
from comera_rec.utils.logs import quiet_foreign_notices

VARIANTS = ("dense_eager", "dense_export", "tt_eager", "tt_export")
BASELINE = "dense_eager"
FIGURES = ("rows_s", "p50_s", "p99_s", "cpu_rows_s", "cpu_p50_s")  # per batch size
INPUTS = "inputs.pt"  # the batches every variant scores, written once by the preparing process

# --quick: 26 small tables, four of them (>= 10k rows) TT-compressed
TINY_TABLE_SIZES = (
    20000, 15000, 300, 40, 12000, 7, 500, 60, 3, 900, 20, 11, 50,
    4, 1000, 30000, 8, 100, 70, 4, 9000, 10, 12, 800, 90, 200,
)  # fmt: skip


@dataclass
class ServingSetup:
    """What the benchmark runs (see :func:`main` for the command line)."""

    batch_sizes: tuple[int, ...] = (1, 64, 512, 4096)
    iters: int = 100
    """Timed batches per batch size and process."""
    warmup: int = 5
    """Untimed batches per batch size first."""
    distinct: int = 8
    """Distinct batches per size, cycled."""
    rounds: int = 1
    """Fresh processes per variant (the variants alternating); medians over them."""
    zipf: float = 1.1
    rank: int = 32
    threads: int = 1
    quick: bool = False
    """Tiny shapes (:data:`TINY_TABLE_SIZES`, dim 8, rank 4)."""
    workdir: Optional[str] = None
    """Where the model files go; a temporary folder (removed) when ``None``."""
    variants: tuple[str, ...] = field(default=VARIANTS)
    start_method: str = "spawn"
    """How the preparing and the eager processes start: ``"spawn"`` (fresh interpreters,
    as servers start) or ``"forkserver"``. Not ``"fork"``: a copy of a process whose
    OpenMP and gloo threads hold locks can hang for ever (it did inside the test suite).
    The exported variants always run in a fresh torch-only interpreter."""


def model_config(kind: str, setup: ServingSetup) -> DLRMConfig:
    """``"dense"``: TorchRec's DLRM as it ships; ``"tt"``: the compressed one, as trained."""
    if setup.quick:
        base = DLRMConfig(
            table_sizes=list(TINY_TABLE_SIZES),
            embedding_dim=8,
            bottom_mlp=[64, 32, 8],
            top_mlp=[64, 32, 1],
            min_rows_to_compress=10_000,
            min_params_to_compress=0,
            rank=4,
            mlp_rank=4,
        )
    else:
        base = DLRMConfig.kaggle(rank=setup.rank, mlp_rank=setup.rank)
    if kind == "dense":
        return replace(base, compressed=False, fused_interaction=False)
    return replace(base, compressed=True, fused_interaction=True)


def batches(setup: ServingSetup, batch_size: int) -> list:
    """``setup.distinct`` synthetic Criteo batches of ``batch_size`` rows, Zipf ids."""
    data = SyntheticCriteo(
        SyntheticCriteoConfig(
            num_embeddings_per_feature=list(model_config("dense", setup).table_sizes),
            zipf_exponent=setup.zipf,
            batch_size=batch_size,
            num_rows=batch_size * setup.distinct,
            seed=1,
            stream="val",
            drop_last=True,
        )
    )
    return list(data)


def paths(workdir: str, kind: str) -> tuple[Path, Path]:
    """``(eager state dict, exported program)`` files of model ``kind``."""
    return Path(workdir) / f"{kind}_state.pt", Path(workdir) / f"{kind}.pt2"


# ------------------------------------------------------------------------------ children


def prepare_child(kinds: str, setup: ServingSetup, queue: Any) -> None:  # runs in a fresh process
    """Build each model of ``kinds`` (comma-separated), save its state dict and its exported
    inference form; check that the program gives the eager logits on one batch."""
    quiet_foreign_notices()
    assert setup.workdir is not None
    names = list(model_config("dense", setup).features())
    torch.save(
        {
            "feature_names": names,
            "batches": {
                b: [(x.dense_features, *kjt_inputs(x.sparse_features, names)) for x in batches(setup, b)]
                for b in setup.batch_sizes
            },
        },
        Path(setup.workdir) / INPUTS,
    )
    out = {}
    for kind in kinds.split(","):
        out[kind] = _prepare(kind, setup)
        torch._dynamo.reset()  # export's caches: the next model is traced afresh
    queue.put(out)
    _leave(queue)


def _prepare(kind: str, setup: ServingSetup) -> dict:
    """:func:`prepare_child` for one model; its parameter count, export time and the
    exported-vs-eager max abs difference on one batch of 64."""
    assert setup.workdir is not None
    torch.manual_seed(0)
    model = build_dlrm(model_config(kind, setup)).eval()
    state_path, program_path = paths(setup.workdir, kind)
    torch.save(model.state_dict(), state_path)
    start = time.perf_counter()
    serving = serving_model(model)
    program = export_dlrm(serving)
    export_s = time.perf_counter() - start
    save_exported(program, program_path)
    batch = batches(replace(setup, distinct=1), 64)[0]
    with torch.inference_mode():
        eager = model(batch.dense_features, batch.sparse_features)
        exported = program.module()(batch.dense_features, *kjt_inputs(batch.sparse_features, serving.feature_names))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "export_s": export_s,
        "max_abs_diff": float((eager - exported).abs().max()),
    }


def load_eager(kind: str, setup: ServingSetup) -> nn.Module:
    """The eager model from its state dict: built on ``meta``, the saved tensors assigned."""
    assert setup.workdir is not None
    model = build_dlrm(model_config(kind, setup), device="meta")
    state = torch.load(paths(setup.workdir, kind)[0], weights_only=True)
    model.load_state_dict(state, assign=True)
    for module in model.modules():  # collections record their device; it follows the tensors
        if hasattr(module, "embedding_bag_configs") and getattr(module, "_device", None) == torch.device("meta"):
            module._device = torch.device("cpu")
    return model.eval()


def measure_child(variant: str, setup: ServingSetup, queue: Any) -> None:  # runs in a fresh process
    """Load one eager variant and score every batch size: load time, rows/s, latencies, peak RSS.

    The inputs come from the prepared file, the KeyedJaggedTensors made before the model is
    loaded (as a reader hands them over; not in the model's RSS)."""
    quiet_foreign_notices()
    torch.set_num_threads(setup.threads)
    kind = variant.split("_")[0]
    assert setup.workdir is not None
    saved = torch.load(Path(setup.workdir) / INPUTS, weights_only=True)
    names = saved["feature_names"]
    inputs = {
        b: [
            (dense, KeyedJaggedTensor.from_lengths_sync(names, values, lengths.reshape(-1)))
            for dense, values, lengths in saved["batches"][b]
        ]
        for b in setup.batch_sizes
    }
    del saved
    base = current_rss_bytes()
    start = time.perf_counter()
    model = load_eager(kind, setup)
    load_s = time.perf_counter() - start
    per_batch = time_batches(model, inputs, setup.warmup, setup.iters)
    queue.put({"load_s": load_s, "base": base, "peak": peak_rss_bytes(), "batch": per_batch})
    _leave(queue)


def time_batches(model: Any, inputs: dict[int, list[tuple]], warmup: int, iters: int) -> dict[int, dict[str, float]]:
    """Per batch size: rows/s over ``iters`` timed calls (after ``warmup``), p50 and p99
    seconds; and by CPU time (``process_time``): rows per CPU second, p50 CPU seconds.

    Args:
        model: called as ``model(*args)`` under ``torch.inference_mode``.
        inputs: per batch size, argument tuples, cycled.
        warmup: untimed calls first.
        iters: timed calls.
    """
    out: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for b, args in inputs.items():
            for i in range(warmup):
                model(*args[i % len(args)])
            times, cpu = [], []
            for i in range(iters):
                t, c = time.perf_counter(), time.process_time()
                model(*args[i % len(args)])
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)  # on a shared host: the time it really ran
            out[b] = {
                "rows_s": b * len(times) / sum(times),
                "p50_s": _quantile(times, 0.5),
                "p99_s": _quantile(times, 0.99),
                "cpu_rows_s": b * len(cpu) / max(sum(cpu), 1e-9),
                "cpu_p50_s": _quantile(cpu, 0.5),
            }
    return out


# The exported variants run in an interpreter that imports torch only, as a server of the
# exported program would: neither comera-rec nor TorchRec is loaded (nor counted in its RSS).
# Its timing loop is time_batches's.
_SERVE_EXPORTED = """
import json, os, resource, sys, time
import torch

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

def quantile(values, q):
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

import torch._export.serde.serialize  # the deserializer's own imports: before the base RSS, as the eager ones

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
saved = torch.load(args["inputs"], weights_only=True)
inputs = {b: saved["batches"][b] for b in args["batch_sizes"]}
del saved
base = rss()
start = time.perf_counter()
model = torch.export.load(args["program"]).module()
load_s = time.perf_counter() - start
per_batch = {}
with torch.inference_mode():
    for b, batches in inputs.items():
        for i in range(args["warmup"]):
            model(*batches[i % len(batches)])
        times, cpu = [], []
        for i in range(args["iters"]):
            t, c = time.perf_counter(), time.process_time()
            model(*batches[i % len(batches)])
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        per_batch[b] = {
            "rows_s": b * len(times) / sum(times),
            "p50_s": quantile(times, 0.5),
            "p99_s": quantile(times, 0.99),
            "cpu_rows_s": b * len(cpu) / max(sum(cpu), 1e-9),
            "cpu_p50_s": quantile(cpu, 0.5),
        }
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_s": load_s, "base": base, "peak": peak, "batch": per_batch}))
sys.stdout.flush()
os._exit(0)  # no teardown
"""


def measure_exported(variant: str, setup: ServingSetup) -> dict:
    """Score with the exported program of ``variant`` in a torch-only interpreter (see
    :data:`_SERVE_EXPORTED`); the same figures as :func:`measure_child`.

    Raises:
        RuntimeError: the interpreter failed (its output is quoted).
    """
    assert setup.workdir is not None
    kind = variant.split("_")[0]
    args = {
        "threads": setup.threads,
        "inputs": str(Path(setup.workdir) / INPUTS),
        "program": str(paths(setup.workdir, kind)[1]),
        "batch_sizes": list(setup.batch_sizes),
        "warmup": setup.warmup,
        "iters": setup.iters,
    }
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_EXPORTED, json.dumps(args)], capture_output=True, text=True, cwd=setup.workdir
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"serving benchmark: the {variant} process failed ({done.returncode}):\n{done.stderr[-4000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["batch"] = {int(b): v for b, v in result["batch"].items()}  # JSON keys are strings
    return result


def _quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics (the largest for one value)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _leave(queue: Any) -> None:
    """Flush the result and leave without the interpreter's teardown (Triton, imported by
    TorchRec, prints leak warnings at a normal exit of every process)."""
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def in_process(target: Any, name: str, setup: ServingSetup) -> dict:
    """``target(name, setup, queue)`` in a fresh process (``setup.start_method``); its result.

    Raises:
        RuntimeError: the child died without a result (its exit code is named).
    """
    ctx = mp.get_context(setup.start_method)
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(name, setup, queue))
    proc.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except Exception:  # queue.Empty: still running, or dead
            if not proc.is_alive() and queue.empty():
                raise RuntimeError(f"serving benchmark: the {name} process exited ({proc.exitcode}) without a result")
    proc.join()
    return result


# ------------------------------------------------------------------------------ the run


@dataclass
class ServingReport:
    """What :func:`run` measured and the markdown tables printed."""

    setup: ServingSetup
    prepared: dict[str, dict]
    """Per model kind: params, export seconds, exported-vs-eager max abs difference."""
    results: dict[str, dict]
    """Per variant: ``load_s``, ``peak``, ``base``, ``file_bytes`` and ``batch`` -> {rows_s, p50_s, p99_s}."""
    table: str


def run(setup: ServingSetup) -> ServingReport:
    """Prepare both models, measure every variant in fresh processes, make the tables."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        setup = replace(setup, workdir=setup.workdir or tmp)
        Path(setup.workdir).mkdir(parents=True, exist_ok=True)
        kinds = sorted({v.split("_")[0] for v in setup.variants})
        prepared = in_process(prepare_child, ",".join(kinds), setup)  # one process builds both
        runs: dict[str, list[dict]] = {v: [] for v in setup.variants}
        for _ in range(setup.rounds):
            for v in setup.variants:  # alternating: the machine's drift hits every variant alike
                runs[v].append(
                    measure_exported(v, setup) if v.endswith("_export") else in_process(measure_child, v, setup)
                )
        results = {}
        for v, rs in runs.items():
            kind, form = v.split("_")
            file = paths(setup.workdir, kind)[0 if form == "eager" else 1]
            results[v] = {
                "load_s": statistics.median(r["load_s"] for r in rs),
                "peak": max(r["peak"] for r in rs),
                "base": min(r["base"] for r in rs),
                "file_bytes": file.stat().st_size,
                "batch": {
                    b: {k: statistics.median(r["batch"][b][k] for r in rs) for k in FIGURES} for b in setup.batch_sizes
                },
            }
    return ServingReport(setup, prepared, results, tables(setup, prepared, results))


def tables(setup: ServingSetup, prepared: dict[str, dict], results: dict[str, dict]) -> str:
    """The markdown tables of a run: per variant and batch size, then per variant."""
    base = results.get(BASELINE)
    lines = [
        "| variant | batch | rows/s | vs dense_eager | p50 ms | p99 ms | p99 vs dense_eager "
        "| rows/CPU-s | vs dense_eager | CPU ms p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in setup.batch_sizes:
        for v, r in results.items():
            x = r["batch"][b]
            ref = base["batch"][b] if base else None
            speed = f"{x['rows_s'] / ref['rows_s']:.2f}x" if ref else "-"
            p99 = f"{x['p99_s'] / ref['p99_s']:.2f}x" if ref else "-"
            cpu_speed = f"{x['cpu_rows_s'] / ref['cpu_rows_s']:.2f}x" if ref else "-"
            lines.append(
                f"| {v} | {b} | {x['rows_s']:,.0f} | {speed} | {x['p50_s'] * 1e3:.3f} | {x['p99_s'] * 1e3:.3f} | {p99} "
                f"| {x['cpu_rows_s']:,.0f} | {cpu_speed} | {x['cpu_p50_s'] * 1e3:.3f} |"
            )
    lines += [
        "",
        "| variant | file | smaller | load s | peak RSS | RSS ratio | peak RSS - imports | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in results.items():
        own = r["peak"] - r["base"]
        smaller = f"{base['file_bytes'] / r['file_bytes']:.1f}x" if base else "-"
        ratio = f"{base['peak'] / r['peak']:.2f}x" if base else "-"
        own_ratio = f"{(base['peak'] - base['base']) / max(own, 1):.1f}x" if base else "-"
        lines.append(
            f"| {v} | {fmt_bytes(r['file_bytes'])} | {smaller} | {r['load_s']:.3f} | {fmt_bytes(r['peak'])} | "
            f"{ratio} | {fmt_bytes(own)} | {own_ratio} |"
        )
    notes = "; ".join(
        f"{k}: {p['params']:,} parameters, export {p['export_s']:.1f} s, exported vs eager max |diff| "
        f"{p['max_abs_diff']:.1e}"
        for k, p in prepared.items()
    )
    lines += ["", notes]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> ServingReport:
    """The command line of ``launch/bench_serving.py`` (``argv``, ``None``: ``sys.argv[1:]``);
    prints the tables and returns the report.

    Example::

        >>> report = main(["--quick"])  # doctest: +SKIP
        >>> report.results["tt_export"]["batch"][64]["rows_s"] > 0  # doctest: +SKIP
        True
    """
    quiet_foreign_notices()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few batches: a smoke run")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 64 512 4096)")
    parser.add_argument("--iters", type=int, default=None, help="timed batches per size and process (default 100)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed batches per size first (default 5)")
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per variant (default 1)")
    parser.add_argument("--rank", type=int, default=32, help="TT rank of tables and MLP layers (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="variants to run")
    parser.add_argument(
        "--start-method",
        choices=["spawn", "forkserver"],
        default=None,
        help="how the measuring processes start (default spawn)",
    )
    parser.add_argument("--workdir", default=None, help="keep the model files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    for name in ("iters", "rounds", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    setup = ServingSetup(rounds=args.rounds, rank=args.rank, threads=args.threads, zipf=args.zipf)
    if args.quick:
        setup = replace(setup, quick=True, batch_sizes=(1, 64, 512), iters=10, warmup=2, distinct=2)
    setup = replace(
        setup,
        batch_sizes=tuple(args.batches) if args.batches else setup.batch_sizes,
        iters=args.iters or setup.iters,
        warmup=args.warmup if args.warmup is not None else setup.warmup,
        variants=tuple(args.variants),
        workdir=args.workdir,
        start_method=args.start_method or setup.start_method,
    )
    shapes = "tiny shapes (--quick)" if setup.quick else f"Criteo Kaggle shapes, rank {setup.rank}"
    print(
        f"serving: {shapes}, Zipf({setup.zipf}) ids, {setup.threads} thread(s) per process, "
        f"{setup.iters} timed batches per size after {setup.warmup}, {setup.rounds} process(es) per variant",
        flush=True,
    )
    report = run(setup)
    print(report.table, flush=True)
    return report
