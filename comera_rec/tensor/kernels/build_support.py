"""The parts of the CPU kernels' build (:mod:`.cpu_extension`) that know nothing of the kernels.

:func:`exclusive_build` locks a build folder against other processes (and clears what a
killed build left), :func:`pinned_ninja_on_path` makes ``cpp_extension`` run the project's
``ninja``, :func:`build_root` says where builds go, :class:`KernelBuild` is what
:func:`~comera_rec.tensor.kernels.cpu_extension.build_cpu_kernels` reports, and
:func:`disabled_by_env` reads a kernel's off switch from the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)


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
            logger.info("waiting for another process loading or building the fused CPU kernels in %s", build_dir)
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


def build_root() -> Path:
    """Where the builds go: ``TORCH_EXTENSIONS_DIR``, else cpp_extension's default root,
    in a ``comera_rec`` folder."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "comera_rec"


@dataclass(frozen=True)
class KernelBuild:
    """What :func:`~comera_rec.tensor.kernels.cpu_extension.build_cpu_kernels` found or did.

    Attributes:
        ready: the kernels are loaded: CPU calls take them (unless switched off later).
        built: they were compiled by this call (``False``: found built, disabled or failed).
        seconds: how long the call took.
        build_dir: where they are cached (``None`` when disabled).
        vector_bytes: the build's vector width (0 when not ready).
        message: the last line said: what happened, for a person.
    """

    ready: bool
    built: bool
    seconds: float
    build_dir: Path | None
    vector_bytes: int
    message: str


def disabled_by_env(name: str) -> bool:
    """Whether the environment variable ``name`` switches a kernel off: set to anything but
    ``""`` / ``"0"`` / ``"false"`` / ``"no"`` / ``"off"``. Read on every call."""
    value = os.environ.get(name)
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")
