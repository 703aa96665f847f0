"""The instruction set a process's CPU code runs: the host's widest, or a narrower one on purpose.

An AVX-512 host can run the code an AVX2 host runs: ATen's kernels, MKL's BLAS, FBGEMM's
lookups and comera-rec's fused kernels each take an environment variable that limits them
to AVX2 (the fused kernels are then built for AVX2: 32-byte vectors, 16 registers, no
AVX-512 instruction). :func:`isa_environment` gives those variables; the DLRM benchmark's
``--isa avx2`` runs itself under them, so that a figure of the AVX2 code can be measured
beside the native one on one machine. What it cannot show is another machine's caches,
clocks and memory: a figure measured so names both (:func:`libraries_isa`).

Example::

    >>> isa_environment("avx2")["MKL_ENABLE_INSTRUCTIONS"]
    'AVX2'
"""

from __future__ import annotations

import os

ISA_CHOICES = ("native", "avx2")
"""``native``: each library's own choice (the host's widest vectors); ``avx2``: AVX2 code."""

# each library's switch and its value for AVX2 code
_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised CPU kernels
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's BLAS (the dense layers' GEMMs)
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",  # FBGEMM's generated lookup and GEMM code
    "COMERA_CPU_VECTOR_BYTES": "32",  # the fused kernels (comera_rec.tensor.kernels.cpu_extension)
}
# the switches torch cannot report on, named in a figure's first line when set
_FORCED = {"MKL_ENABLE_INSTRUCTIONS": "MKL", "FBGEMM_ENABLE_INSTRUCTIONS": "FBGEMM"}


def _cpuinfo() -> str:
    """``/proc/cpuinfo``'s text (``""`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags_line() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (``""`` where there is none)."""
    return next((line + "\n" for line in _cpuinfo().splitlines() if line.startswith("flags")), "")


def cpu_model(cpuinfo: str | None = None) -> str:
    r"""The CPU's name with its family and model numbers, from the first processor of
    ``/proc/cpuinfo`` (or of the given text); ``""`` where it names none.

    Cloud hosts often report only a brand (``AMD EPYC``) for CPUs of several generations
    whose caches and vector units differ (AMD's family 25 model 1 is Zen 3, model 17 Zen 4),
    so a benchmark's first line gives the numbers too.

    Args:
        cpuinfo: text in ``/proc/cpuinfo``'s format; ``None`` reads this host's.

    Example::

        >>> cpu_model("cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n")
        'AMD EPYC (family 25, model 17)'
    """
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "")
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    if not (name and family.isdigit() and model.isdigit()):
        return name
    return f"{name} (family {family}, model {model})"


def host_cpu_flags() -> set[str]:
    """This host's CPU flags from ``/proc/cpuinfo`` (empty where there is none)."""
    return set(cpu_flags_line().partition(":")[2].split())


def check_host_runs(isa: str, flags: set[str] | None = None) -> None:
    """Raise unless this host (its CPU ``flags``; default :func:`host_cpu_flags`) can run
    ``isa``'s code: ``avx2`` needs an x86 CPU with AVX2 and FMA.

    Raises:
        ValueError: the host lacks it, or an unknown ``isa``.
    """
    isa_environment(isa)  # an unknown name is named first
    if isa == "avx2":
        flags = host_cpu_flags() if flags is None else flags
        missing = sorted({"avx2", "fma"} - flags)
        if missing:
            raise ValueError(f"instruction set avx2: this host's CPU lacks {', '.join(missing)} (from /proc/cpuinfo)")


def cpu_bfloat16_products() -> bool:
    """Whether torch multiplies bfloat16 matrices on this CPU with oneDNN's kernels, as it
    decides itself (oneDNN has them for x86 CPUs with AVX-512 or AVX2-VNNI-2 and Arm CPUs
    with BF16). Elsewhere (an AVX2 x86 CPU such as AMD's Zen 3) a bfloat16 product runs in a
    reference loop: 0.95 GFLOP/s against float32's 165 for a 1024^3 product on such a host
    (2026-12-05). ``True`` where torch cannot tell (nothing to refuse then).

    Example::

        >>> cpu_bfloat16_products() in (True, False)
        True
    """
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN, or without the query
        return True


def isa_environment(isa: str) -> dict[str, str]:
    """The environment variables that make a fresh process's CPU code ``isa``'s.

    Args:
        isa: one of :data:`ISA_CHOICES`; ``"native"`` needs none (``{}``).

    Returns:
        Variable -> value, to be set before the process imports torch.

    Raises:
        ValueError: an ``isa`` not in :data:`ISA_CHOICES`.
    """
    if isa not in ISA_CHOICES:
        raise ValueError(f"instruction set {isa!r}: expected one of {', '.join(ISA_CHOICES)}")
    return dict(_AVX2) if isa == "avx2" else {}


def environment_applies(wanted: dict[str, str], environ: dict[str, str] | None = None) -> bool:
    """Whether ``environ`` (default ``os.environ``) already holds every variable of ``wanted``."""
    environ = os.environ if environ is None else environ
    return all(environ.get(name) == value for name, value in wanted.items())


def libraries_isa(environ: dict[str, str] | None = None) -> str:
    """What the libraries' CPU code runs, for a figure's first line: ATen's capability as
    torch reports it, and MKL's and FBGEMM's where a switch limits them.

    Example::

        >>> libraries_isa()  # doctest: +SKIP
        'ATen AVX2, MKL AVX2 (forced), FBGEMM AVX2 (forced)'
    """
    import torch

    environ = os.environ if environ is None else environ
    parts = [f"ATen {torch.backends.cpu.get_cpu_capability()}"]
    for name, library in _FORCED.items():
        if environ.get(name):
            parts.append(f"{library} {environ[name]} (forced)")
    return ", ".join(parts)
