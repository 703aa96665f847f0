"""The fused CPU kernels' vector width: the host's widest by default, another one on demand.

The kernels are written once over vectors of ``COMERA_VECTOR_BYTES`` (64 with AVX-512, 32
with AVX2, 16 elsewhere). A host checks its own width in the other kernel tests; here the
same tests run again in a build of another width, so that an AVX2 machine checks the
AVX-512 code (and an AVX-512 machine the AVX2 code) for correctness.
"""

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comera_rec.tensor import kernels
from comera_rec.tensor.kernels import cpu_extension
from comera_rec.tensor.kernels.tt_linear_cpu import max_fused_rank

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
# the tests of every fused CPU kernel, run again at the other width
KERNEL_TESTS = [
    "tests/tensor/test_tt_linear_kernel.py",
    "tests/tensor/test_tt_chain_kernel.py",
    "tests/tensor/test_tt_chains.py",
    "tests/tensor/test_cpu_kernel.py",
    "tests/integration/test_rowwise_bag_kernel.py",
    "tests/dlrm/test_interaction.py",
]
# the kernels' three extensions (the tensor core's, DLRM's interaction, the row-wise Adagrad
# tables), each built in a process of its own so that the three builds at the other width run
# at once (one process builds one extension at a time); the tests above then find them built
BUILDS = [
    "from comera_rec.tensor import kernels; assert kernels.cpu_kernel_enabled()",
    "from comera_rec.dlrm.interaction_kernel import EXTENSION; assert EXTENSION.enabled()",
    "from comera_rec.integration.rowwise_bag_kernel import EXTENSION; assert EXTENSION.enabled()",
]


def host_vector_bytes() -> int:
    """The widest vectors this x86-64 host has, read from /proc/cpuinfo."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    return 64 if "avx512f" in flags else 32 if "avx" in flags else 16


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").exists(),
    reason="reads x86 flags from /proc/cpuinfo",
)
def test_build_uses_the_host_width_or_the_forced_one() -> None:
    forced = os.environ.get(cpu_extension.VECTOR_BYTES_ENV)
    assert kernels.cpu_vector_bytes() == (int(forced) if forced else host_vector_bytes())


def test_bad_forced_width_is_named(monkeypatch) -> None:
    monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, "48")
    with pytest.raises(ValueError, match=f"{cpu_extension.VECTOR_BYTES_ENV}='48'.*16, 32, 64"):
        cpu_extension._forced_vector_bytes()


def test_fused_rank_limit_is_256_bytes_of_rank() -> None:
    width = kernels.cpu_vector_bytes()
    assert max_fused_rank(torch.float32) == min(256, 8 * width) // 4
    assert max_fused_rank(torch.float64) == min(256, 8 * width) // 8
    x = torch.randn(4, 8)
    r = max_fused_rank(torch.float32)
    assert kernels.tt_linear_kernel_applies(x, torch.randn(8, r), torch.randn(r, 5))
    assert not kernels.tt_linear_kernel_applies(x, torch.randn(8, r + 1), torch.randn(r + 1, 5))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 widths")
def test_emulated_widths_build_at_o1_native_ones_at_o3(monkeypatch) -> None:
    monkeypatch.setattr(cpu_extension, "_cpu_flags_line", lambda: "flags\t\t: sse2 avx avx2 fma")  # an AVX2 host
    for width, level in (("", "-O3"), ("16", "-O3"), ("32", "-O3"), ("64", "-O1")):
        monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, width)
        flags = cpu_extension._build_spec()[2]
        assert level in flags and ({"-O1", "-O3"} - {level}).isdisjoint(flags), (width, flags)
    monkeypatch.setattr(cpu_extension, "_cpu_flags_line", lambda: "flags\t\t: avx avx2 avx512f")  # AVX-512
    monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, "64")
    assert "-O3" in cpu_extension._build_spec()[2]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 widths")
def test_narrower_widths_build_the_narrower_instruction_set(monkeypatch) -> None:
    # on an AVX-512 host a 32-byte build is an AVX2 machine's code: no AVX-512 instruction
    # (its 32 registers, masks), in a build folder of its own; a 16-byte build has no AVX
    monkeypatch.setattr(cpu_extension, "_cpu_flags_line", lambda: "flags\t\t: sse2 avx avx2 fma avx512f avx512vl")
    expected = {"": ("", None), "64": ("_v64", None), "32": ("_v32avx2", "-mno-avx512f"), "16": ("_v16sse", "-mno-avx")}
    for width, (suffix, flag) in expected.items():
        monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, width)
        name, _, flags = cpu_extension._build_spec()
        assert name.endswith("_" + cpu_extension._source_tag() + suffix), (width, name)
        assert [f for f in flags if f.startswith("-mno-")] == ([flag] if flag else []), (width, flags)
    monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, "32")
    assert cpu_extension._target_description("32").startswith("AVX2 code on an AVX-512 host (32-byte vectors")
    # an AVX2 host's own width is its own instruction set: nothing to take away
    monkeypatch.setattr(cpu_extension, "_cpu_flags_line", lambda: "flags\t\t: sse2 avx avx2 fma")
    name, _, flags = cpu_extension._build_spec()
    assert name.endswith("_v32") and not any(f.startswith("-mno-") for f in flags)
    assert cpu_extension._target_description("32") == "32-byte vectors (COMERA_CPU_VECTOR_BYTES=32)"
    monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, "16")
    assert cpu_extension._build_spec()[2][-1] == "-mno-avx"


# AVX-512's own registers and masks in AT&T syntax: zmm, ymm16-31 / xmm16-31, and a {%k} mask
_AVX512_OPERANDS = re.compile(r"%zmm|%[xy]mm(?:1[6-9]|2\d|3[01])\b|\{%k[1-7]\}")


def avx512_instructions(library: Path) -> list[str]:
    """The lines of ``objdump -d library`` that use an AVX-512 register or mask."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if _AVX512_OPERANDS.search(line)]


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get(cpu_extension.VECTOR_BYTES_ENV)), reason="already a forced-width run")
def test_kernel_tests_pass_at_another_width(tmp_path) -> None:
    # 64-byte vectors on a host without AVX-512 are emulated by the compiler: slow, but the
    # same code and the same results; 32-byte vectors run natively on an AVX-512 host
    other = "32" if kernels.cpu_vector_bytes() == 64 else "64"
    env = {**os.environ, cpu_extension.VECTOR_BYTES_ENV: other}
    builds = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for code in BUILDS
    ]
    try:
        for code, build in zip(BUILDS, builds):
            out = build.communicate(timeout=1500)[0]
            assert build.returncode == 0, f"{code!r} at {other}-byte vectors failed:\n{out[-4000:]}"
    finally:
        for build in builds:  # after a failed build, the others (and their compilers) are not left running
            if build.poll() is None:
                os.killpg(build.pid, signal.SIGKILL)
                build.wait()
    if other == "32" and shutil.which("objdump"):  # AVX-512 host: the AVX2 build has no AVX-512 instruction
        monkey = pytest.MonkeyPatch()
        try:
            monkey.setenv(cpu_extension.VECTOR_BYTES_ENV, other)
            name, build_dir, _ = cpu_extension._build_spec()
        finally:
            monkey.undo()
        found = avx512_instructions(build_dir / f"{name}.so")
        assert not found, f"{len(found)} AVX-512 instructions in the AVX2 build, e.g. {found[:3]}"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "t"),
            *KERNEL_TESTS,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, f"kernel tests at {other}-byte vectors failed:\n{tail}"
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
