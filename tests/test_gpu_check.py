"""comera_rec.gpu_check on CPU: the no-GPU path, the commands it would run, the summary table."""

from __future__ import annotations

import json
import subprocess
import sys

from comera_rec import gpu_check
from comera_rec.gpu_check import ROOT, Step


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(capsys) -> None:
    assert gpu_check.main([], cuda=False) == 0
    out = capsys.readouterr().out
    assert out == gpu_check.NO_GPU + "\n"


def test_module_entry_point_on_this_machine() -> None:
    proc = subprocess.run([sys.executable, "-m", "comera_rec.gpu_check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == [gpu_check.NO_GPU]


def test_pytest_commands_one_gpu_leave_out_the_nccl_test() -> None:
    steps = gpu_check.pytest_steps("py", 1)
    assert [s.argv for s in steps] == [
        ["py", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"]
        + ["--deselect", "tests/gpu/test_cuda.py::test_nccl_two_process_all_reduce"],
        ["py", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + ["tests/tensor/test_triton_kernels.py", "tests/tensor/test_static_lookup.py"]
        + ["tests/training/test_cuda_graph.py"],
    ]
    assert all(s.passed is None for s in steps)


def test_pytest_commands_two_gpus_keep_the_nccl_test() -> None:
    assert all("--deselect" not in s.argv for s in gpu_check.pytest_steps("py", 2))


def test_the_selected_test_files_exist() -> None:
    for _, paths in gpu_check.GPU_TESTS:
        assert all((ROOT / p).exists() for p in paths)
    for node in gpu_check.DISTRIBUTED_TESTS:
        path, name = node.split("::")
        assert f"def {name}(" in (ROOT / path).read_text()


def test_bench_command() -> None:
    s = gpu_check.bench_step("py", steps=20)
    assert s.argv == ["py", "-m", "comera_rec.dlrm.bench_device", "--device", "cuda", "--batch-size", "2048"] + [
        "--steps",
        "20",
        "--rank",
        "32",
        "--variants",
        "dense",
        "tt",
    ]


def test_bench_figures_and_pytest_figures() -> None:
    lines = [
        json.dumps(dict(variant="dense", step_ms=12.345, samples_per_s=165900, peak_device_bytes=3 * 2**30)),
        "noise",
        json.dumps(dict(variant="tt", step_ms=8.0, samples_per_s=256000, peak_device_bytes=None)),
    ]
    assert gpu_check.bench_figures("\n".join(lines)) == (
        "dense 12.35 ms (165,900 samples/s, 3.00 GiB peak); tt 8.00 ms (256,000 samples/s)"
    )
    out = "....s.\n=== short test summary info ===\nSKIPPED [1] x\n5 passed, 1 skipped in 3.21s\n"
    assert gpu_check.pytest_figures(out) == "5 passed, 1 skipped in 3.21s"


def test_summary_table() -> None:
    steps = [Step("tests", ["x"], True, "5 passed"), Step("bench", ["y"], False, "exit 1"), Step("other", ["z"])]
    assert gpu_check.summary_table(steps).splitlines() == [
        "| check | result | figures |",
        "|---|---|---|",
        "| tests | pass | 5 passed |",
        "| bench | FAIL | exit 1 |",
        "| other | not run |  |",
    ]


def test_missing_gpu_packages() -> None:
    cpu = {
        "torch": "2.13.0+cpu",
        "triton": "3.9.0",
        "fbgemm-gpu": "1.8",
        "fbgemm-gpu-cpu": "1.8.0",
        "cuda (torch build)": "-",
    }
    assert gpu_check.missing_gpu_packages(cpu) == ["a CUDA torch", "fbgemm-gpu (CUDA)"]
    gpu = {
        "torch": "2.14.1",
        "triton": "3.5",
        "fbgemm-gpu": "1.9.0",
        "fbgemm-gpu-cpu": "-",
        "cuda (torch build)": "12.8",
    }
    assert gpu_check.missing_gpu_packages(gpu) == []


FULL_GPU_SET = {
    "torch": "2.14.1",
    "triton": "3.5",
    "fbgemm-gpu": "1.9.0",
    "fbgemm-gpu-cpu": "-",
    "torchrec": "1.9.2",
    "cuda (torch build)": "12.8",
}


def test_dry_run_on_a_pretend_gpu_runs_nothing(capsys, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check, "gpus", lambda: ["cuda:0 Fake, 80 GiB, sm_90"])
    monkeypatch.setattr(gpu_check, "versions", lambda: dict(FULL_GPU_SET))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert gpu_check.main(["--dry-run"], cuda=True) == 0
    out = capsys.readouterr().out
    assert "GPUs: cuda:0 Fake" in out and "-m comera_rec.dlrm.bench_device --device cuda" in out and "--deselect" in out


def test_without_torchrec_the_tensor_core_alone_is_checked(capsys, monkeypatch) -> None:
    """A bare CUDA torch (no TorchRec, no CUDA fbgemm-gpu): the TorchRec test files and the
    DLRM benchmark are left out, the tensor-core benchmark stays."""
    monkeypatch.setattr(gpu_check, "gpus", lambda: ["cuda:0 Fake, 80 GiB, sm_90"])
    monkeypatch.setattr(gpu_check, "versions", lambda: {**FULL_GPU_SET, "torchrec": "-", "fbgemm-gpu": "-"})
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert gpu_check.main(["--dry-run"], cuda=True) == 0
    out = capsys.readouterr().out
    assert "the tensor core alone is checked" in out and "launch/bench_gpu.py" in out
    assert "comera_rec.dlrm.bench_device" not in out and "test_cuda_graph.py" not in out
    assert "tests/tensor/test_static_lookup.py" in out


def test_bench_figures_reads_both_benchmarks() -> None:
    lines = [
        '{"bench": "lookup_step", "variant": "tt_triton", "batch": 2048, "ms": 1.5, "vs_dense": 2.0, "peak_bytes": 1073741824}',
        '{"bench": "linear_fwd_bwd", "variant": "tt", "batch": 2048, "ms": 0.1, "vs_dense": 0.5}',
        '{"variant": "dense", "step_ms": 3.0, "samples_per_s": 1000, "peak_device_bytes": null}',
    ]
    figures = gpu_check.bench_figures("\n".join(lines))
    assert figures == "lookup B=2048 tt_triton 1.500 ms (x2.0 dense, 1.00 GiB peak); dense 3.00 ms (1,000 samples/s)"


def test_torchrec_without_cuda_fbgemm_runs_the_plain_benchmark(capsys, monkeypatch) -> None:
    """TorchRec over the CPU fbgemm-gpu: the TorchRec test files run, and the DLRM benchmark
    runs without FBGEMM (graphed TT, dense with sparse tables), said so, never the FBGEMM one."""
    monkeypatch.setattr(gpu_check, "gpus", lambda: ["cuda:0 Fake, 80 GiB, sm_90"])
    cpu_fbgemm = {**FULL_GPU_SET, "fbgemm-gpu": "-", "fbgemm-gpu-cpu": "1.6.0"}
    monkeypatch.setattr(gpu_check, "versions", lambda: cpu_fbgemm)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert gpu_check.main(["--dry-run"], cuda=True) == 0
    out = capsys.readouterr().out
    assert "FBGEMM's CUDA kernels are missing" in out and "test_cuda_graph.py" in out
    bench = [line for line in out.splitlines() if "comera_rec.dlrm.bench_device" in line]
    assert len(bench) == 2 and all("--plain" in line for line in bench)
    assert "--graphed --variants tt" in bench[0] and "--sparse-tables --variants dense" in bench[1]
