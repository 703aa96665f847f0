"""isa_environment: the switches that limit each library's CPU code to AVX2, as the
libraries read them in a fresh process; libraries_isa names what runs."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comera_rec.utils.isa import (
    ISA_CHOICES,
    check_host_runs,
    cpu_bfloat16_products,
    cpu_model,
    environment_applies,
    host_cpu_flags,
    isa_environment,
    libraries_isa,
)


def test_native_needs_no_switch_and_avx2_sets_every_library() -> None:
    assert isa_environment("native") == {}
    avx2 = isa_environment("avx2")
    assert avx2 == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
        "COMERA_CPU_VECTOR_BYTES": "32",
    }
    avx2["MKL_ENABLE_INSTRUCTIONS"] = "changed"  # a copy: the table itself stays
    assert isa_environment("avx2")["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert set(ISA_CHOICES) == {"native", "avx2"}


def test_unknown_isa_is_named() -> None:
    with pytest.raises(ValueError, match=r"instruction set 'avx10'.*native, avx2"):
        isa_environment("avx10")


def test_environment_applies_only_when_every_variable_matches() -> None:
    wanted = isa_environment("avx2")
    assert environment_applies(wanted, dict(wanted, OTHER="1"))
    assert not environment_applies(wanted, {k: v for k, v in wanted.items() if k != "FBGEMM_ENABLE_INSTRUCTIONS"})
    assert not environment_applies(wanted, dict(wanted, ATEN_CPU_CAPABILITY="avx512"))
    assert environment_applies({}, {})


def test_libraries_isa_names_the_forced_switches_only() -> None:
    assert "MKL" not in libraries_isa({}) and libraries_isa({}).startswith("ATen ")
    line = libraries_isa(isa_environment("avx2"))
    assert "MKL AVX2 (forced)" in line and "FBGEMM AVX2 (forced)" in line


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= host_cpu_flags(),
    reason="needs an x86 host with AVX2",
)
def test_torch_runs_avx2_code_under_the_switch() -> None:
    # torch reads ATEN_CPU_CAPABILITY once, at its first dispatch: a fresh interpreter
    code = "from comera_rec.utils.isa import libraries_isa; print(libraries_isa())"
    env = {**os.environ, **isa_environment("avx2")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ATen AVX2, MKL AVX2 (forced), FBGEMM AVX2 (forced)"


def test_a_host_without_avx2_is_refused_by_name() -> None:
    check_host_runs("native", set())
    check_host_runs("avx2", {"sse2", "avx", "avx2", "fma"})
    with pytest.raises(ValueError, match="lacks avx2, fma"):
        check_host_runs("avx2", {"sse2", "avx"})
    with pytest.raises(ValueError, match="instruction set 'avx10'"):
        check_host_runs("avx10", {"avx2", "fma"})


def test_host_cpu_flags_reads_this_machine() -> None:
    flags = host_cpu_flags()
    if Path("/proc/cpuinfo").exists() and platform.machine() in ("x86_64", "AMD64"):
        assert "sse2" in flags
    else:
        assert isinstance(flags, set)


ZEN4_TWO_CORES = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: Another CPU
"""


def test_cpu_model_gives_the_family_and_model_numbers_of_the_first_processor() -> None:
    assert cpu_model(ZEN4_TWO_CORES) == "AMD EPYC (family 25, model 17)"
    intel = "cpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz\n"
    assert cpu_model(intel) == "Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz (family 6, model 207)"
    # no numbers (an Arm host's cpuinfo has none of these fields), or no name
    assert cpu_model("model name\t: Some CPU\n") == "Some CPU"
    assert cpu_model("processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n") == ""
    assert cpu_model("") == ""


def test_cpu_model_reads_this_machine() -> None:
    model = cpu_model()
    assert isinstance(model, str)
    if Path("/proc/cpuinfo").exists() and platform.machine() in ("x86_64", "AMD64"):
        assert "(family " in model and ", model " in model


def test_cpu_bfloat16_products_agrees_with_the_cpu_flags() -> None:
    # torch's own answer against /proc/cpuinfo read another way: oneDNN's bfloat16 kernels
    # start at AVX-512 (F, BW, VL, DQ) on x86; an AVX2 CPU without AVX-NE-CONVERT has none
    flags = host_cpu_flags()
    if not flags or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 host's /proc/cpuinfo")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert cpu_bfloat16_products()
    elif "avx512f" not in flags and "avx_ne_convert" not in flags:
        assert not cpu_bfloat16_products()
    else:
        pytest.skip(f"a CPU between the two kinds: {sorted(f for f in flags if f.startswith('avx'))}")


@pytest.mark.parametrize("torch_says, expected", [(True, True), (False, False)])
def test_cpu_bfloat16_products_is_torchs_check(monkeypatch, torch_says: bool, expected: bool) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: torch_says)
    assert cpu_bfloat16_products() is expected


def test_cpu_bfloat16_products_refuses_nothing_where_torch_cannot_tell(monkeypatch) -> None:
    def missing() -> bool:
        raise RuntimeError("no oneDNN in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    assert cpu_bfloat16_products() is True
