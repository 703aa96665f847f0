"""Validate a GPU machine: versions, the GPU test subset, a short benchmark, one table.

    python -m comera_rec.gpu_check        # or: make gpu-check
    python -m comera_rec.gpu_check --dry-run   # print the commands it would run

On a machine without CUDA it says so in one line and exits 0. On a CUDA machine it
(a) prints the torch / CUDA / triton / fbgemm-gpu / torchrec versions and the GPUs,
(b) runs the tests that exercise the GPU paths with pytest (``tests/gpu``, which skips
without CUDA, and the CPU-checked Triton / static-lookup / CUDA-graph files, now against a
CUDA torch), (c) runs ``comera_rec.dlrm.bench_device`` at Kaggle shapes (dense TorchRec with FBGEMM's
CUDA TBE vs compressed) and prints one summary table. With TorchRec over the CPU
fbgemm-gpu (no CUDA kernels of FBGEMM) the TorchRec tests still run, and the benchmark runs
``--plain``: the compressed step as one CUDA graph against the dense model with sparse
table updates, neither through FBGEMM. It installs nothing: when the GPU set is missing
(triton, a CUDA fbgemm-gpu) it prints the install command (docs/gpu.md).
Exit status: 0 when everything that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALL_HINT = 'pip install -r requirements/gpu.txt -e ".[dev,gpu]"'
NO_GPU = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check."

# the tests that exercise the GPU paths: tests/gpu needs CUDA (skips without); the others run on
# CPU too (Triton interpreter and ahead-of-time compiles, static lookups, CUDA graphs with a
# stand-in backend) and are run again here against the CUDA build
GPU_TESTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tests on CUDA (tests/gpu)", ("tests/gpu",)),
    (
        "Triton, static lookup, CUDA-graph tests",
        (
            "tests/tensor/test_triton_kernels.py",
            "tests/tensor/test_static_lookup.py",
            "tests/training/test_cuda_graph.py",
        ),
    ),
)
# test files that import TorchRec: left out (and said so) where it is not installed, so the
# tensor core's GPU paths can be checked on a bare CUDA torch
NEEDS_TORCHREC = ("tests/training/test_cuda_graph.py",)
DISTRIBUTED_TESTS = ("tests/gpu/test_cuda.py::test_nccl_two_process_all_reduce",)
PACKAGES = ("torch", "triton", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec")


@dataclass
class Step:
    """One thing the check runs (a command) and, once run, its outcome."""

    name: str
    argv: list[str]
    passed: bool | None = None  # None: not run
    figures: str = ""
    detail: list[str] = field(default_factory=list)


def versions() -> dict[str, str]:
    """Installed versions of the packages that matter on a GPU (``"-"``: not installed), and CUDA's."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "-"
    import torch

    out["cuda (torch build)"] = torch.version.cuda or "-"
    return out


def gpus() -> list[str]:
    """``"cuda:i NAME, X GiB, sm_XY"`` for every visible GPU (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    return found


def missing_gpu_packages(found: dict[str, str]) -> list[str]:
    """What the GPU set lacks: triton, a CUDA torch, the CUDA fbgemm-gpu (not the CPU one)."""
    missing = []
    if found.get("triton", "-") == "-":
        missing.append("triton")
    if found.get("cuda (torch build)", "-") == "-" or "+cpu" in found.get("torch", ""):
        missing.append("a CUDA torch")
    if found.get("fbgemm-gpu-cpu", "-") != "-" or found.get("fbgemm-gpu", "-") == "-":
        missing.append("fbgemm-gpu (CUDA)")
    return missing


def pytest_steps(python: str, n_gpus: int, torchrec: bool = True) -> list[Step]:
    """The pytest commands, as data. The two-process nccl test is selected only with >= 2 GPUs;
    the files that import TorchRec only with ``torchrec``.

    Example::

        >>> [s.argv[3:] for s in pytest_steps("py", 1)][0]
        ['-q', '-rs', '-p', 'no:cacheprovider', 'tests/gpu', '--deselect', 'tests/gpu/test_cuda.py::test_nccl_two_process_all_reduce']
    """
    steps = []
    for name, paths in GPU_TESTS:
        if not torchrec:
            paths = tuple(p for p in paths if p not in NEEDS_TORCHREC)
        argv = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *paths]
        if n_gpus < 2:
            argv += [a for t in DISTRIBUTED_TESTS if t.split("::")[0].startswith(paths) for a in ("--deselect", t)]
        steps.append(Step(name, argv))
    return steps


def bench_step(python: str, steps: int = 50, batch_size: int = 2048, rank: int = 32) -> Step:
    """The benchmark command, as data: Kaggle shapes, dense (FBGEMM TBE) and TT, on cuda."""
    argv = [python, "-m", "comera_rec.dlrm.bench_device", "--device", "cuda", "--batch-size", str(batch_size)]
    argv += ["--steps", str(steps), "--rank", str(rank), "--variants", "dense", "tt"]
    return Step(f"DLRM Kaggle step, batch {batch_size}, rank {rank}", argv)


def plain_bench_steps(python: str, steps: int = 30, batch_size: int = 2048, rank: int = 32) -> list[Step]:
    """The benchmark without FBGEMM's CUDA kernels, as data: the compressed step as one CUDA
    graph, then the dense model with sparse table updates (eager: sparse updates are not
    captured). Not the FBGEMM baseline; the names say so."""
    base = [
        python,
        "-m",
        "comera_rec.dlrm.bench_device",
        "--device",
        "cuda",
        "--plain",
        "--batch-size",
        str(batch_size),
    ]
    base += ["--steps", str(steps), "--rank", str(rank)]
    return [
        Step(f"DLRM Kaggle step, TT graphed, no FBGEMM, batch {batch_size}", base + ["--graphed", "--variants", "tt"]),
        Step(
            f"DLRM Kaggle step, dense sparse tables, no FBGEMM, batch {batch_size}",
            base + ["--sparse-tables", "--variants", "dense"],
        ),
    ]


def tensor_bench_step(python: str, repeats: int = 30) -> Step:
    """The tensor-core benchmark (``launch/bench_gpu.py``, no TorchRec): TTM lookup steps
    (Triton, PyTorch path, one CUDA graph) and TT layers against dense torch modules."""
    argv = [python, "launch/bench_gpu.py", "--repeats", str(repeats)]
    return Step("tensor core: Kaggle TT tables and MLP layers vs dense torch", argv)


def pytest_figures(output: str) -> str:
    """pytest's last summary line (``"12 passed, 1 skipped in 3.4s"``)."""
    lines = [line.strip("= ") for line in output.strip().splitlines() if line.startswith("=") or " in " in line]
    return lines[-1] if lines else ""


def bench_figures(output: str) -> str:
    """``dense 12.3 ms, tt 8.1 ms`` from the benchmark's JSON lines (with peak memory when known)."""
    parts = []
    for line in output.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "bench" in r:  # launch/bench_gpu.py
            if r["bench"] == "lookup_step":
                peak = f", {r['peak_bytes'] / 2**30:.2f} GiB peak" if r.get("peak_bytes") else ""
                parts.append(f"lookup B={r['batch']} {r['variant']} {r['ms']:.3f} ms (x{r['vs_dense']} dense{peak})")
            continue
        if "variant" not in r:
            continue
        peak = f", {r['peak_device_bytes'] / 2**30:.2f} GiB peak" if r.get("peak_device_bytes") else ""
        parts.append(f"{r['variant']} {r['step_ms']:.2f} ms ({r['samples_per_s']:,} samples/s{peak})")
    return "; ".join(parts)


def summary_table(steps: list[Step]) -> str:
    """One markdown table: what ran, pass / fail / not run, figures.

    Example::

        >>> print(summary_table([Step("a", ["x"], True, "3 passed"), Step("b", ["y"])]))
        | check | result | figures |
        |---|---|---|
        | a | pass | 3 passed |
        | b | not run |  |
    """
    rows = ["| check | result | figures |", "|---|---|---|"]
    for s in steps:
        result = "not run" if s.passed is None else ("pass" if s.passed else "FAIL")
        rows.append(f"| {s.name} | {result} | {s.figures} |")
    return "\n".join(rows)


def run_step(step: Step, figures) -> Step:
    print(f"\n$ {' '.join(step.argv)}", flush=True)
    proc = subprocess.run(step.argv, cwd=ROOT, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    print(out[-6000:], flush=True)
    step.passed = proc.returncode == 0
    step.figures = figures(proc.stdout) or (f"exit {proc.returncode}" if not step.passed else "")
    return step


def main(argv: list[str] | None = None, cuda: bool | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    parser.add_argument("--bench-steps", type=int, default=50)
    args = parser.parse_args(argv)
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if not cuda:
        print(NO_GPU)
        return 0
    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    devices = gpus()
    print("GPUs: " + ("; ".join(devices) or "none visible"))
    missing = missing_gpu_packages(found)
    if missing:
        print(f"missing from the GPU set: {', '.join(missing)}. Install it with: {INSTALL_HINT}")
    torchrec = found["torchrec"] != "-"
    fbgemm_cuda = "fbgemm-gpu (CUDA)" not in missing
    if not torchrec:
        print("TorchRec is missing: the tensor core alone is checked")
    elif not fbgemm_cuda:
        print("FBGEMM's CUDA kernels are missing: the DLRM runs without them (--plain), not against FBGEMM")
    steps = pytest_steps(sys.executable, len(devices), torchrec)
    if not args.no_bench:
        steps.append(tensor_bench_step(sys.executable))
        if torchrec and fbgemm_cuda:
            steps.append(bench_step(sys.executable, args.bench_steps))
        elif torchrec:
            steps += plain_bench_steps(sys.executable)
    if args.dry_run:
        for s in steps:
            print(" ".join(s.argv))
        return 0
    for s in steps:
        run_step(s, pytest_figures if s.argv[1:3] == ["-m", "pytest"] else bench_figures)
    print("\n" + summary_table(steps))
    return 0 if all(s.passed for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
