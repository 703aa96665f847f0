"""The fused CPU TTM lookup (``ttm_cpu.cpp``): its build on first use and its autograd function.

The kernel keeps both levels of de-duplication of the PyTorch path but needs no sort
and forms nothing of a table's size: every id's prefix and suffix key is given a slot
through a direct-address array over the (small) key space of each half, each distinct
prefix and suffix is contracted once, and one pass per bag contracts prefix x suffix
and pools. The backward sends each row's gradient into its two slots, then the slots'
gradients into the core slices, every write owned by one thread (no atomics).

The extension is compiled by ``torch.utils.cpp_extension`` the first time a CPU lookup
needs it (tens of seconds, once per machine: it is cached under
``TORCH_EXTENSIONS_DIR/comera_rec``, by default ``~/.cache/torch_extensions/comera_rec``;
a build killed half-way is cleaned up by the next, :func:`exclusive_build`). Without a C++
compiler the build fails once, with a warning, and lookups take the PyTorch path;
``COMERA_DISABLE_CPU_KERNEL=1`` or :func:`set_cpu_kernel_enabled(False)
<set_cpu_kernel_enabled>` choose the PyTorch path on purpose.

The kernels' vectors are as wide as the build machine's: 64 bytes with AVX-512, 32 with
AVX2, 16 elsewhere (:func:`cpu_vector_bytes`), their register tiles sized for 32 vector
registers with AVX-512 and 16 otherwise. ``COMERA_CPU_VECTOR_BYTES=16|32|64`` builds, in a
build of its own, the code of a machine with that widest vector (its width and its tiles):
the tests check the other machine's code this way; a width wider than the hardware's is
correct but slow.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "COMERA_DISABLE_CPU_KERNEL"
VECTOR_BYTES_ENV = "COMERA_CPU_VECTOR_BYTES"
_VECTOR_BYTES_CHOICES = ("16", "32", "64")
_SOURCES = [Path(__file__).with_name(name) for name in (
    "ttm_cpu.cpp", "tt_linear_cpu.cpp", "interaction_cpu.cpp", "checks_cpu.cpp", "rowwise_bag_cpu.cpp"
)]
_HEADERS = [Path(__file__).with_name("simd.h")]
_enabled = True
_build_lock = threading.Lock()


def _host_tag() -> str:
    """A short tag of this CPU's instruction set: the build uses ``-march=native``, so a
    cache shared by different machines must not hand one machine's build to another."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _source_tag() -> str:
    """A short hash of where the sources are and of the headers they include.

    ``cpp_extension`` rebuilds when a source changes but does not see the headers, so a
    changed header makes a new build name; and two checkouts (a clone beside a working
    copy) get build folders of their own instead of rewriting one folder's build file with
    their paths, where one process could load a library the other is rebuilding.
    """
    parts = [str(_SOURCES[0].parent.resolve()).encode()] + [p.read_bytes() for p in _HEADERS]
    return hashlib.sha1(b"\0".join(parts)).hexdigest()[:8]


def _forced_vector_bytes() -> str:
    """``COMERA_CPU_VECTOR_BYTES`` (``""`` when unset: the build machine's widest vectors)."""
    value = os.environ.get(VECTOR_BYTES_ENV, "").strip()
    if value and value not in _VECTOR_BYTES_CHOICES:
        raise ValueError(f"{VECTOR_BYTES_ENV}={value!r}: expected one of {', '.join(_VECTOR_BYTES_CHOICES)} (bytes)")
    return value


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold an operating-system lock on ``build_dir`` while an extension builds or loads there.

    ``cpp_extension`` guards a build with a ``lock`` file, which a killed build leaves
    behind (SIGKILL, or the SIGTERM torchrun sends every rank when one fails during the
    first build); every later process then waits on that file forever, silently. An
    ``fcntl`` lock ends with the process that holds it: while we hold it no other process
    of ours is building here, so a ``lock`` file found is stale and is removed.

    Args:
        build_dir: the extension's build folder (created if missing).

    Example::

        with exclusive_build(Path("~/.cache/torch_extensions/comera_rec/name").expanduser()):
            module = torch.utils.cpp_extension.load(name="name", sources=[...], build_directory=...)
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: cpp_extension's own lock file only
        yield
        return
    with open(build_dir / "comera.flock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the fused CPU kernels in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by an interrupted build of the fused CPU kernels", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def pinned_ninja_on_path() -> Iterator[None]:
    """Put the ``ninja`` of the project's Python environment first on ``PATH`` while a build runs.

    ``cpp_extension`` runs whichever ``ninja`` ``PATH`` finds. A process started as
    ``.venv/bin/python`` (as ``make`` does) does not have ``.venv/bin`` on ``PATH``, so it
    found the system's ninja (or none: then no fused kernels at all), while an activated
    shell found the pinned one; the two write build logs in different formats, and each
    discarded the other's and rebuilt every kernel (about a minute) on the first step of
    the next run. Restored on exit.

    Example::

        with pinned_ninja_on_path():
            assert shutil.which("ninja").startswith(ninja.BIN_DIR)
    """
    try:
        import ninja

        ninja_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):  # no ninja package: the interpreter's scripts folder
        import sysconfig

        ninja_dir = sysconfig.get_path("scripts")
    saved = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja_dir] + ([saved] if saved else []))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


def _build_root() -> Path:
    """Where the builds go: ``TORCH_EXTENSIONS_DIR``, else cpp_extension's default root,
    in a ``comera_rec`` folder."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "comera_rec"


@functools.lru_cache(maxsize=None)
def _extension():
    """The compiled module, or ``None`` when it cannot be built (logged once)."""
    width = _forced_vector_bytes()  # a bad value is the caller's error, not a failed build
    with _build_lock:
        try:
            from torch.utils.cpp_extension import load

            flags = ["-O3", "-fopenmp"] + (["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])
            if width:  # the vectors and register tiles of a machine whose widest vectors are these
                flags += [f"-DCOMERA_VECTOR_BYTES={width}", f"-DCOMERA_VECTOR_REGISTERS={32 if width == '64' else 16}"]
            name = f"comera_cpu_{_host_tag()}_{_source_tag()}" + (f"_v{width}" if width else "")
            build_dir = _build_root() / name
            if not (build_dir / f"{name}.so").exists():  # else a check of the sources, under a second
                logger.info("building the fused CPU kernels in %s (once per machine and source version, "
                            "about a minute)", build_dir)
            with exclusive_build(build_dir), pinned_ninja_on_path():
                return load(
                    name=name, sources=[str(p) for p in _SOURCES], build_directory=str(build_dir),
                    extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False,
                )
        except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch path still works
            logger.warning("fused CPU kernels unavailable (%s); lookups and TT layers use the PyTorch path", exc)
            return None


@functools.lru_cache(maxsize=None)
def cpu_vector_bytes() -> int:
    """The vector width (bytes) of the fused CPU kernels' build: 64 with AVX-512, 32 with
    AVX2, 16 elsewhere, or ``COMERA_CPU_VECTOR_BYTES``. 0 when the kernels do not build."""
    ext = _extension()
    return int(ext.vector_bytes()) if ext is not None else 0


def disabled_by_env(name: str) -> bool:
    """Whether the environment variable ``name`` switches a kernel off: set to anything but
    ``""`` / ``"0"`` / ``"false"`` / ``"no"`` / ``"off"``. Read on every call."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def set_cpu_kernel_enabled(enabled: bool) -> None:
    """Turn the fused CPU lookup on or off for this process (the environment switch still wins)."""
    global _enabled
    _enabled = bool(enabled)


def cpu_kernel_enabled() -> bool:
    """Whether CPU lookups take the fused kernel: not disabled, and it builds.

    ``COMERA_DISABLE_CPU_KERNEL`` set to anything but ``""`` / ``"0"`` / ``"false"``
    disables it; it is read on every call.
    """
    return not disabled_by_env(DISABLE_ENV) and _enabled and _extension() is not None


def cpu_float_tensors_apply(*tensors: torch.Tensor) -> bool:
    """Whether the CPU kernels may take these operands: real CPU float32 / float64 tensors
    of one dtype, outside tracing and ``torch.compile``, kernels enabled (each kernel's
    ``*_applies`` adds its own shape limits)."""
    return (
        all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in tensors)
        and len({t.dtype for t in tensors}) == 1
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
        and cpu_kernel_enabled()
    )


def cpu_kernel_applies(cores: Sequence[torch.Tensor], ids: torch.Tensor) -> bool:
    """Whether a lookup is the fused CPU kernel's to do: real CPU float32 / float64
    tensors of 2 to 4 cores, outside tracing and ``torch.compile``, kernel enabled."""
    return 2 <= len(cores) <= 4 and ids.device.type == "cpu" and cpu_float_tensors_apply(*cores)


_EMPTY = torch.empty(0, dtype=torch.long)


class _FusedTTMBag(torch.autograd.Function):
    """``(ids, offsets, trains, weights, dim, batch, *cores) -> (B, dim)`` summed bags, or
    ``(batch, B / batch * dim)`` with ``batch > 0`` (bag ``f * batch + b`` in row ``b``)."""

    @staticmethod
    def forward(ctx, ids, offsets, trains, weights, dim, batch, *cores):
        out, pslot, sslot, pkeys, skeys, ptab, stab = _extension().ttm_bag_forward(
            list(cores), ids, trains, offsets, weights, dim, batch
        )
        ctx.save_for_backward(offsets, weights, pslot, sslot, pkeys, skeys, ptab, stab, *cores)
        ctx.layout = (dim, batch)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        offsets, weights, pslot, sslot, pkeys, skeys, ptab, stab, *cores = ctx.saved_tensors
        weights_need_grad = bool(ctx.needs_input_grad[3]) and weights.numel() > 0
        *grad_cores, grad_weights = _extension().ttm_bag_backward(
            grad_out, cores, offsets, weights, pslot, sslot, pkeys, skeys, ptab, stab, weights_need_grad, *ctx.layout
        )
        return (None, None, None, grad_weights if weights_need_grad else None, None, None, *grad_cores)


class _GatherBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, col, width, *sources):
        ctx.map = (src, col, width, [s.shape[1] for s in sources])
        return _extension().gather_blocks(list(sources), src, col, width)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        src, col, width, widths = ctx.map
        return (None, None, None, *_extension().scatter_blocks(grad, widths, src, col, width))


def check_jagged(
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor | None,
    batch: int,
    bounds: Sequence[int],
) -> tuple[int, int, int, int]:
    """Check a key-major jagged batch in one pass (CPU tensors, the kernels built; the caller checks).

    Args:
        values: the ids, keys one after the other.
        lengths: ``(keys * batch,)`` bag lengths.
        offsets: ``(keys * batch + 1,)`` or ``None``.
        batch: bags per key.
        bounds: per key, ids must lie in ``[0, bound)``; a negative bound leaves the key unchecked.

    Returns:
        ``(code, position, sum of lengths, key)``: code 0 all good, 1 a negative length at
        bag ``position``, 2 offsets that disagree with the lengths at bag ``position``, 3 an
        id out of its key's range at ``position`` of ``values``.
    """
    empty = _EMPTY if offsets is None else offsets
    code, pos, total, key = _extension().check_jagged(values, lengths, empty, int(batch), list(bounds))
    return int(code), int(pos), int(total), int(key)


def gather_column_blocks(sources: Sequence[torch.Tensor], blocks: Sequence[tuple[int, int]], width: int) -> torch.Tensor:
    """Column blocks of several ``(B, C_s)`` matrices side by side, in one pass over the rows.

    ``torch.cat([sources[s][:, c : c + width] for s, c in blocks], dim=1)`` with a backward
    that writes each source's gradient once (the blocks must not overlap). CPU float
    tensors with the fused kernel built (:func:`cpu_kernel_enabled`); the caller checks.

    Args:
        sources: ``(B, C_s)`` matrices, one ``B``.
        blocks: ``(source, first column)`` of every output block, in output order.
        width: columns per block.

    Returns:
        ``(B, len(blocks) * width)``.
    """
    src = [int(s) for s, _ in blocks]
    col = [int(c) for _, c in blocks]
    return _GatherBlocks.apply(src, col, int(width), *sources)


def ttm_embedding_bag_cpu(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
    *,
    stream_batch: int = 0,
) -> torch.Tensor:
    """The fused CPU lookup with the signature of ``contract.ttm_embedding_bag``.

    The caller checks :func:`cpu_kernel_applies` first. Ids out of the TT row shape's
    range, or table indices out of the stack, raise an error naming the value.

    Returns:
        ``(B, embedding_dim)`` pooled embeddings, or with ``stream_batch > 0`` the bags
        as ``(stream_batch, B / stream_batch * embedding_dim)`` (stream ``f``'s bags in
        columns ``f * embedding_dim ...``), written so by the kernel.
    """
    cores = list(cores)
    shape = tuple(int(c.shape[2]) for c in cores)
    if tuple(int(n) for n in row_shape) != shape:
        raise ValueError(f"ttm_embedding_bag: row_shape {tuple(row_shape)} does not match the cores' {shape}")
    weights = per_sample_weights if per_sample_weights is not None else _EMPTY.to(cores[0].dtype)
    batch = int(stream_batch)
    out = _FusedTTMBag.apply(
        ids, offsets, trains if trains is not None else _EMPTY, weights, int(embedding_dim), batch, *cores
    )  # (B, D), or (batch, streams * D)
    if mode == "mean":
        from comera_rec.tensor.contract import divide_bags  # contract imports this package

        out = divide_bags(out, (offsets[1:] - offsets[:-1]).clamp_min(1), batch)
    return out
