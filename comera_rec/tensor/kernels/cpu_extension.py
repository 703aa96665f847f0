"""The build of the fused CPU kernels (the tensor core's extension and those of the layers
above), their loader and the switches that turn them on and off (the lookup itself:
:mod:`.ttm_cpu`).

The extension is compiled by ``torch.utils.cpp_extension`` during set-up
(:func:`build_cpu_kernels`, which ``python -m comera_rec.tensor.kernels`` and ``make``'s
install step run), else the first time a CPU call needs it (1-3 min, once per machine and
source version: that call waits, and the log says so). It is cached under
``TORCH_EXTENSIONS_DIR/comera_rec``, by default ``~/.cache/torch_extensions/comera_rec``;
a build killed half-way is cleaned up by the next, :func:`exclusive_build`. Without a C++
compiler the build fails once, with a warning, and lookups take the PyTorch path;
``COMERA_DISABLE_CPU_KERNEL=1`` or :func:`set_cpu_kernel_enabled(False)
<set_cpu_kernel_enabled>` choose the PyTorch path on purpose.

The kernels' vectors are as wide as the build machine's: 64 bytes with AVX-512, 32 with
AVX2, 16 elsewhere (:func:`cpu_vector_bytes`), their register tiles sized for 32 vector
registers with AVX-512 and 16 otherwise. ``COMERA_CPU_VECTOR_BYTES=16|32|64`` builds, in a
build of its own, the code of a machine with that widest vector (its width and its tiles;
narrower than the host's, its instruction set too: 32 bytes on an AVX-512 host is AVX2 code,
without AVX-512's registers and masks): the tests check the other machine's code this way,
and ``comera_rec.utils.isa`` runs an AVX2 host's code on an AVX-512 one; a width wider than
the hardware's is correct but slow.

The layers above the tensor core keep their own CPU kernels (DLRM's pairwise-dot
interaction in ``dlrm/``, the row-wise Adagrad tables in ``comera_rec/integration/``), each
a small extension of its own built the same way (:class:`CpuExtension`), registered at
import (:func:`register_cpu_extension`) so that :func:`build_cpu_kernels` builds them too:
this package never imports them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from comera_rec.tensor.kernels.build_support import (  # the build's helpers (importable from here too)
    KernelBuild,
    build_root,
    disabled_by_env,
    exclusive_build,
    pinned_ninja_on_path,
)
from comera_rec.utils.isa import cpu_flags_line, cpu_model

logger = logging.getLogger(__name__)

DISABLE_ENV = "COMERA_DISABLE_CPU_KERNEL"
VECTOR_BYTES_ENV = "COMERA_CPU_VECTOR_BYTES"
_VECTOR_BYTES_CHOICES = ("16", "32", "64")
# simd.h, aten_ops.h, python_module.h: on the include path of every build (CpuExtension's too)
KERNELS_DIR = Path(__file__).parent
_SOURCES = [KERNELS_DIR / name for name in ("ttm_cpu.cpp", "tt_linear_cpu.cpp", "checks_cpu.cpp")]
_HEADERS = [KERNELS_DIR / name for name in ("simd.h", "aten_ops.h", "python_module.h")]
_PREFIX = "comera_cpu"  # the tensor core's extension: comera_cpu_<host>_<sources>[_v<width>]
BUILD_TIME = "1-3 min"  # the three sources: 61 s on 2 AVX2 cores (2026-11-28), less with more (ninja runs one per core)
_registered: list["CpuExtension"] = []  # the other layers' extensions (register_cpu_extension)
_enabled = True
_build_lock = threading.Lock()
_quiet_build = False  # build_cpu_kernels says its own lines around the build
_build_error: str | None = None  # why the last build failed


def _cpu_flags_line() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (``""`` where there is none); the tests stand
    in another host's line here."""
    return cpu_flags_line()


def _host_tag() -> str:
    """A short tag of this CPU's instruction set: the build uses ``-march=native``, so a
    cache shared by different machines must not hand one machine's build to another."""
    return hashlib.sha1((platform.machine() + _cpu_flags_line()).encode()).hexdigest()[:8]


def _x86_vectors() -> tuple[str, int] | None:
    """This x86 host's widest vector instructions and their bytes, from its CPU flags:
    ``("AVX2", 32)``; ``None`` on another machine or without a flags line."""
    flags = set(_cpu_flags_line().partition(":")[2].split())
    if platform.machine() not in ("x86_64", "AMD64") or not flags:
        return None
    for flag, name, size in (("avx512f", "AVX-512", 64), ("avx2", "AVX2", 32), ("avx", "AVX", 32)):
        if flag in flags:
            return name, size
    return "SSE2", 16


def _target_description(width: str) -> str:
    """What the build targets, for the log: ``"AVX2 (32-byte vectors)"``, or the forced width
    (``"AVX2 code on an AVX-512 host (32-byte vectors, COMERA_CPU_VECTOR_BYTES=32)"``)."""
    if width:
        isa = _narrower_isa(width)[0]
        if isa:
            host = _x86_vectors()
            return f"{isa.upper()} code on an {host[0] if host else '?'} host ({width}-byte vectors, {VECTOR_BYTES_ENV}={width})"
        return f"{width}-byte vectors ({VECTOR_BYTES_ENV}={width})"
    machine = platform.machine()
    x86 = _x86_vectors()
    if x86 is not None:
        return f"{x86[0]} ({x86[1]}-byte vectors)"
    if machine in ("aarch64", "arm64"):
        return "NEON (16-byte vectors)"
    return f"{machine} (this CPU's widest vectors)"


def _emulated(width: str) -> bool:
    """Whether a forced width is wider than this x86 host's vectors (64 bytes without
    AVX-512, 32 without AVX)."""
    if not width or platform.machine() not in ("x86_64", "AMD64"):
        return False
    x86 = _x86_vectors()
    return int(width) > (x86[1] if x86 is not None else 16)


def _source_tag(sources: Sequence[Path] | None = None) -> str:
    """A short hash of where the sources are and of the headers they include.

    ``cpp_extension`` rebuilds when a source changes but does not see the headers, so a
    changed header makes a new build name; and two checkouts (a clone beside a working
    copy) get build folders of their own instead of rewriting one folder's build file with
    their paths, where one process could load a library the other is rebuilding.
    """
    parts = [str(Path((sources or _SOURCES)[0]).parent.resolve()).encode()] + [p.read_bytes() for p in _HEADERS]
    return hashlib.sha1(b"\0".join(parts)).hexdigest()[:8]


def _forced_vector_bytes() -> str:
    """``COMERA_CPU_VECTOR_BYTES`` (``""`` when unset: the build machine's widest vectors)."""
    value = os.environ.get(VECTOR_BYTES_ENV, "").strip()
    if value and value not in _VECTOR_BYTES_CHOICES:
        raise ValueError(f"{VECTOR_BYTES_ENV}={value!r}: expected one of {', '.join(_VECTOR_BYTES_CHOICES)} (bytes)")
    return value


# A forced width narrower than the host's builds the narrower machine's instruction set, not
# only its vector width: -march=native alone would leave AVX-512's 32 registers and masked
# forms to the compiler in a 32-byte build, which an AVX2 machine does not have.
_NARROWER_ISA = {"32": ("avx2", ["-mno-avx512f"]), "16": ("sse", ["-mno-avx"])}


def _narrower_isa(width: str) -> tuple[str, list[str]]:
    """``(name suffix, compiler flags)`` that limit a build at the forced ``width`` to the
    instruction set of a machine whose widest vectors those are, where this x86 host has
    wider ones (``("avx2", ["-mno-avx512f"])`` for 32 bytes on an AVX-512 host); ``("", [])``
    otherwise."""
    if not width or platform.machine() not in ("x86_64", "AMD64"):
        return "", []
    x86 = _x86_vectors()
    if x86 is None or int(width) >= x86[1]:
        return "", []
    suffix, flags = _NARROWER_ISA[width]
    return suffix, list(flags)


def _build_spec(prefix: str = _PREFIX, sources: Sequence[Path] | None = None) -> tuple[str, Path, list[str]]:
    """``(name, build folder, compiler flags)`` of this machine's build (and of
    ``COMERA_CPU_VECTOR_BYTES``, which makes a build of its own): of the tensor core's
    extension, or of the extension ``prefix`` of ``sources`` (:class:`CpuExtension`)."""
    width = _forced_vector_bytes()
    # vectors wider than the host's are emulated by the compiler: such a build checks the
    # other width's code, it is not for speed, and -O1 halves its build (158 -> 79 s)
    level = "-O1" if _emulated(width) else "-O3"
    flags = [level, "-fopenmp"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])
    isa, isa_flags = _narrower_isa(width)
    if width:  # the vectors and register tiles of a machine whose widest vectors are these
        flags += [f"-DCOMERA_VECTOR_BYTES={width}", f"-DCOMERA_VECTOR_REGISTERS={32 if width == '64' else 16}"]
    flags += isa_flags
    name = f"{prefix}_{_host_tag()}_{_source_tag(sources)}" + (f"_v{width}{isa}" if width else "")
    return name, build_root() / name, flags


def _needs_build(name: str, build_dir: Path, sources: Sequence[Path] | None = None) -> bool:
    """Whether loading will compile: no library yet, or a source newer than it (a changed
    header makes a new name, :func:`_source_tag`). Else loading is a check, under a second."""
    try:
        built = (build_dir / f"{name}.so").stat().st_mtime
    except OSError:
        return True
    return any(Path(p).stat().st_mtime > built for p in (sources or _SOURCES))


def _load(
    prefix: str,
    sources: Sequence[Path],
    what: str,
    fallback: str,
    ahead: str,
    quiet: bool,
    defines: Sequence[str] = (),
    python_module: bool = True,
) -> tuple[object | None, str | None]:
    """Build (when needed) and load the extension ``prefix`` of ``sources``: ``(module,
    None)``, or ``(None, why)`` when it cannot be built (logged). ``what`` names it in the
    log, ``fallback`` says what runs instead, ``ahead`` the command that builds it at set-up;
    ``quiet``: the caller says its own lines around a build. ``defines``: preprocessor
    macros of this build; ``python_module=False``: a library of PyTorch operators, loaded
    with ``torch.ops.load_library`` (the module is then the library's path, a ``str``)."""
    _forced_vector_bytes()  # a bad value is the caller's error, not a failed build
    with _build_lock:
        try:
            from torch.utils.cpp_extension import load

            name, build_dir, flags = _build_spec(prefix, sources)
            flags = flags + [f"-D{macro}" for macro in defines]
            if not python_module:  # its kernels bind to nothing outside it (loaded with RTLD_GLOBAL)
                flags.append("-fvisibility=hidden")
            building = _needs_build(name, build_dir, sources)
            if building and not quiet:
                logger.info(
                    "building %s for %s in %s: once per machine and source version, "
                    "%s, and this call waits for it (%s builds them "
                    "ahead, as `make`'s set-up does)",
                    what,
                    _target_description(_forced_vector_bytes()),
                    build_dir,
                    BUILD_TIME,
                    ahead,
                )
            start = time.perf_counter()
            with exclusive_build(build_dir), pinned_ninja_on_path():
                module = load(
                    name=name,
                    sources=[str(p) for p in sources],
                    build_directory=str(build_dir),
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    extra_include_paths=[str(KERNELS_DIR)],
                    is_python_module=python_module,
                    verbose=False,
                )
            if building and not quiet:
                logger.info("built %s in %.0f s (cached in %s)", what, time.perf_counter() - start, build_dir)
            return module, None
        except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch path still works
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            logger.warning("%s unavailable (%s); %s", what, exc, fallback)
            return None, why


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled module of the tensor core's CPU kernels (the ``.cpp`` sources of this
    package), or ``None`` when it cannot be built (logged once). The one loader: the other
    kernel modules call it too.

    Built here when nothing built before (:func:`build_cpu_kernels` at set-up): the call
    that first needs a kernel waits for the build, and the log says how long it may take.
    """
    global _build_error
    module, _build_error = _load(
        _PREFIX,
        _SOURCES,
        "the fused CPU kernels",
        "lookups and TT layers use the PyTorch path",
        "`python -m comera_rec.tensor.kernels`",
        _quiet_build,
    )
    return module


class CpuExtension:
    """A C++ extension of another layer's fused CPU kernels, built as the tensor core's is.

    The same compiler flags and vector width (``COMERA_CPU_VECTOR_BYTES`` included), build
    cache, lock and ``ninja``; ``simd.h`` of this package is on the include path. Switched
    on and off with the tensor core's kernels (:func:`set_cpu_kernel_enabled`,
    ``COMERA_DISABLE_CPU_KERNEL``). Its sources bind their own functions
    (``PYBIND11_MODULE``), so no name is shared with another extension. The layer that owns
    the sources makes one at import and registers it (:func:`register_cpu_extension`), so
    that :func:`build_cpu_kernels` builds it too; else it builds on first use.

    Args:
        prefix: the build's name before the host and source tags (one per extension).
        sources: the ``.cpp`` files (the first one's folder names the build, with the headers).
        what: how the log names it, e.g. ``"DLRM's fused CPU interaction kernel"``.
        fallback: what runs when it cannot be built, for the log.
        defines: preprocessor macros of its build (``"NAME"`` or ``"NAME=VALUE"``).
        python_module: ``False``: a library of PyTorch operators (``TORCH_LIBRARY``), not
            a Python module; :meth:`load` then registers them in this process and returns
            the library's path.

    Example::

        EXT = register_cpu_extension(
            CpuExtension("comera_dlrm_cpu", [Path(__file__).with_name("interaction_cpu.cpp")], "...", "...")
        )
        module = EXT.load()  # None when it cannot be built
    """

    def __init__(
        self,
        prefix: str,
        sources: Sequence[Path],
        what: str,
        fallback: str,
        *,
        defines: Sequence[str] = (),
        python_module: bool = True,
    ) -> None:
        self.prefix = prefix
        self.sources = [Path(p) for p in sources]
        self.defines = tuple(defines)
        self.python_module = python_module
        self.what = what
        self.fallback = fallback
        self.error: str | None = None  # why the last build failed
        self.quiet = False  # build_cpu_kernels says its own lines around the build
        self.load = functools.lru_cache(maxsize=None)(self._load)

    def _load(self):
        """The compiled module, or ``None`` when it cannot be built (logged once); cached
        (``load.cache_clear()`` loads again)."""
        module, self.error = _load(
            self.prefix,
            self.sources,
            self.what,
            self.fallback,
            "`python -m comera_rec.tensor.kernels <its module>`",
            self.quiet,
            self.defines,
            self.python_module,
        )
        return module

    def spec(self) -> tuple[str, Path, list[str]]:
        """``(name, build folder, compiler flags)`` of this machine's build."""
        return _build_spec(self.prefix, self.sources)

    def enabled(self) -> bool:
        """Whether its kernels take calls: the CPU kernels not switched off, and it builds."""
        return cpu_kernels_switched_on() and self.load() is not None

    def build(self, say: Callable[[str], None]) -> bool:
        """Build (or find built) and load it now, saying a line before and after a build or
        after a failure; whether it is loaded."""
        name, build_dir, _ = self.spec()
        building = self.load.cache_info().currsize == 0 and _needs_build(name, build_dir, self.sources)
        if building:
            say(f"building {self.what} in {build_dir}, once per machine and source version")
        start = time.perf_counter()
        self.quiet = True
        try:
            module = self.load()
        finally:
            self.quiet = False
        if module is None:
            say(f"{self.what} could not be built ({self.error}): {self.fallback}")
        elif building:
            say(f"built {self.what} in {time.perf_counter() - start:.0f} s, cached in {build_dir}")
        return module is not None


def register_cpu_extension(ext: CpuExtension) -> CpuExtension:
    """Have :func:`build_cpu_kernels` build ``ext`` after the tensor core's kernels (once per
    extension); returns it. The layers above the tensor core register theirs at import."""
    if all(e is not ext for e in _registered):
        _registered.append(ext)
    return ext


def registered_cpu_extensions() -> tuple[CpuExtension, ...]:
    """The extensions :func:`build_cpu_kernels` builds besides the tensor core's."""
    return tuple(_registered)


def _compiler_found() -> bool:
    """Whether the C++ compiler cpp_extension runs (``CXX``, else ``c++``) is on ``PATH``."""
    return shutil.which(os.environ.get("CXX") or "c++") is not None


def build_cpu_kernels(say: Callable[[str], None] | None = None) -> KernelBuild:
    """Build (or find built) the fused CPU kernels now, not in the first call that needs them:
    the tensor core's, then those registered by the modules imported so far
    (:func:`register_cpu_extension`: DLRM's interaction, the row-wise Adagrad tables).

    Runs the loader the kernels use (:func:`extension`: same build folder, lock and
    ``ninja``), saying one line before a build (the target, the folder, how long) and one
    after (the time, the cache). Run by ``python -m comera_rec.tensor.kernels`` and so by
    ``make``'s set-up; a trainer may call it before its loop, so that no training step
    waits for a build. Never raises for a missing compiler or a failed build: it says so,
    and CPU calls take the PyTorch path (same values, slower).

    Args:
        say: where the lines go (default: this module's logger at INFO).

    Returns:
        A :class:`KernelBuild` of the tensor core's kernels, its message their line (a
        registered extension says its own lines after it, only when it builds or fails).

    Example::

        >>> result = build_cpu_kernels(print)  # doctest: +SKIP
        building the fused CPU kernels for AVX2 (32-byte vectors) in ~/.cache/..., once per machine and source version, 1-3 min
        built the fused CPU kernels in 151 s: AVX2 (32-byte vectors), cached in ~/.cache/...
    """
    global _quiet_build
    say = say or logger.info
    start = time.perf_counter()
    if disabled_by_env(DISABLE_ENV) or not _enabled:
        by_env = disabled_by_env(DISABLE_ENV)
        why = f"{DISABLE_ENV}={os.environ[DISABLE_ENV]}" if by_env else "set_cpu_kernel_enabled(False)"
        message = f"the fused CPU kernels are disabled ({why}): nothing to build, CPU calls take the PyTorch path"
        say(message)
        return KernelBuild(False, False, time.perf_counter() - start, None, 0, message)
    name, build_dir, _ = _build_spec()
    target = _target_description(_forced_vector_bytes())
    loaded = extension.cache_info().currsize > 0  # loaded (or failed) earlier in this process
    building = not loaded and _needs_build(name, build_dir)
    if building:
        say(
            f"building the fused CPU kernels for {target} in {build_dir}, once per machine and source version, "
            f"{BUILD_TIME}"
        )
    _quiet_build = True
    try:
        ext = extension()
    finally:
        _quiet_build = False
    seconds = time.perf_counter() - start
    if ext is None:
        reason = "no C++ compiler found (CXX, else c++ on PATH)" if not _compiler_found() else _build_error
        message = (
            f"the fused CPU kernels could not be built ({reason}): CPU calls take the PyTorch path "
            f"(same values, slower); with g++ installed, `python -m comera_rec.tensor.kernels` builds them"
        )
        say(message)
        return KernelBuild(False, False, seconds, build_dir, 0, message)
    width = int(ext.vector_bytes())
    what = target if _forced_vector_bytes() or f"({width}-byte" in target else f"{width}-byte vectors"
    if building:
        message = f"built the fused CPU kernels in {seconds:.0f} s: {what}, cached in {build_dir}"
    else:
        message = f"the fused CPU kernels are built: {what}, cached in {build_dir} (checked in {seconds:.1f} s)"
    say(message)
    for other in _registered:  # the other layers' kernels, a line each when built or failed
        other.build(say)
    return KernelBuild(True, building, seconds, build_dir, width, message)


# a constant of the process: torch.compile takes its value, not a trace of the loader
@torch.compiler.assume_constant_result
def cpu_vector_bytes() -> int:
    """The vector width (bytes) of the fused CPU kernels' build: 64 with AVX-512, 32 with
    AVX2, 16 elsewhere, or ``COMERA_CPU_VECTOR_BYTES``. 0 when the kernels do not build."""
    return _built_vector_bytes()


@functools.lru_cache(maxsize=None)
def _built_vector_bytes() -> int:
    ext = extension()
    return int(ext.vector_bytes()) if ext is not None else 0


cpu_vector_bytes.cache_clear = _built_vector_bytes.cache_clear  # type: ignore[attr-defined]  # as an lru_cache


def host_description() -> str:
    """One line saying where a figure was measured: the instruction set and vector width the
    CPU kernels target, the CPU model (:func:`~comera_rec.utils.isa.cpu_model`: its name, family
    and model numbers) and the cores this process may use.

    Example::

        >>> host_description()  # doctest: +SKIP
        'AVX2 (32-byte vectors); AMD EPYC 7B13 (family 25, model 1); 2 cores'
    """
    model = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [_target_description(_forced_vector_bytes()), model or platform.processor() or platform.machine()]
    return "; ".join(p for p in parts if p) + f"; {cores} cores"


def set_cpu_kernel_enabled(enabled: bool) -> None:
    """Turn the fused CPU lookup on or off for this process (the environment switch still wins)."""
    global _enabled
    _enabled = bool(enabled)


def cpu_kernels_switched_on() -> bool:
    """Whether the CPU kernels are on: neither ``COMERA_DISABLE_CPU_KERNEL`` nor
    :func:`set_cpu_kernel_enabled(False) <set_cpu_kernel_enabled>` (built or not)."""
    return not disabled_by_env(DISABLE_ENV) and _enabled


def cpu_kernel_enabled() -> bool:
    """Whether CPU lookups take the fused kernel: not disabled, and it builds.

    ``COMERA_DISABLE_CPU_KERNEL`` set to anything but ``""`` / ``"0"`` / ``"false"``
    disables it; it is read on every call.
    """
    return _enabled and not disabled_by_env(DISABLE_ENV) and cpu_kernels_built()


@torch.compiler.assume_constant_result  # (as cpu_vector_bytes)
def cpu_kernels_built() -> bool:
    """Whether the CPU kernels' extension builds and loads (built on the first call)."""
    return extension() is not None
