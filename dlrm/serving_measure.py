"""The serving benchmark's processes (:mod:`comera_rec.dlrm.serving`): the one that builds,
saves and exports the models, those that load one variant and time it (eager in a fresh
Python process, exported in a torch-only interpreter), and the timing loop they share."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.dlrm.export import export_dlrm, kjt_inputs, save_exported, serving_model
from comera_rec.dlrm.model import build_dlrm
from comera_rec.dlrm.serving_ops import operator_library
from comera_rec.dlrm.serving_setup import INPUTS, ServingSetup, batches, model_config, paths, variant_file
from comera_rec.tensor import cached_weights
from comera_rec.utils.benchmark import current_rss_bytes, peak_rss_bytes
from comera_rec.utils.host import SERVING_MMAP_THRESHOLD, freed_memory_environment, keep_freed_memory
from comera_rec.utils.logs import quiet_foreign_notices


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
        out[kind] = _prepare(kind, setup, kernels=kind == "tt" and "tt_kernels" in setup.variants)
        torch._dynamo.reset()  # export's caches: the next model is traced afresh
    queue.put(out)
    _leave(queue)


def _prepare(kind: str, setup: ServingSetup, kernels: bool = False) -> dict:
    """:func:`prepare_child` for one model; its parameter count, export time and the
    exported-vs-eager max abs difference on one batch of 64 (``kernels``: also the program
    calling the operator library, and its difference)."""
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
    args = (batch.dense_features, *kjt_inputs(batch.sparse_features, serving.feature_names))
    with torch.inference_mode():
        eager = model(batch.dense_features, batch.sparse_features)
        exported = program.module()(*args)
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "export_s": export_s,
        "max_abs_diff": float((eager - exported).abs().max()),
    }
    if kernels:
        program = export_dlrm(serving_model(model, kernels=True))
        save_exported(program, variant_file(setup.workdir, f"{kind}_kernels"))
        with torch.inference_mode():
            out["kernels_max_abs_diff"] = float((eager - program.module()(*args)).abs().max())
    return out


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
    if setup.heap_reuse:
        keep_freed_memory(mmap_threshold_bytes=SERVING_MMAP_THRESHOLD)
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
        model: called as ``model(*args)`` under ``torch.inference_mode`` and
            :func:`~comera_rec.tensor.cached_weights`.
        inputs: per batch size, argument tuples, cycled.
        warmup: untimed calls first.
        iters: timed calls.
    """
    out: dict[int, dict[str, float]] = {}
    # the compressed model's cores folded and laid out once, as a server keeps them
    with torch.inference_mode(), cached_weights():
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
if args["library"]:  # the operators a kernels program calls (their library's RSS counts as the model's)
    torch.ops.load_library(args["library"])
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
    library = operator_library() if variant.endswith("_kernels") else None
    args = {
        "threads": setup.threads,
        "inputs": str(Path(setup.workdir) / INPUTS),
        "program": str(variant_file(setup.workdir, variant)),
        "library": str(library) if library is not None else None,
        "batch_sizes": list(setup.batch_sizes),
        "warmup": setup.warmup,
        "iters": setup.iters,
    }
    env = dict(os.environ)
    if setup.heap_reuse:  # keep_freed_memory's settings, by glibc's environment tunables (no import)
        env.update(freed_memory_environment(SERVING_MMAP_THRESHOLD))
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_EXPORTED, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=setup.workdir,
        env=env,
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
