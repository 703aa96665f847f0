"""Logging set-up shared by the entry points."""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# Loggers whose warnings speak to another project's developers, not to a user of this one.
FOREIGN_NOTICE_LOGGERS: tuple[str, ...] = (
    # torch's notice, once per process (so once per rank), that torchrec's modules call
    # `is_fx_tracing`, which cannot tell fx tracing from torch.export
    "torch.fx._symbolic_trace",
)

# Python warnings of the same kind, as (category, start of the message).
FOREIGN_NOTICE_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # torch's DDP, once per DDP wrapper and rank, about the argument DistributedModelParallel
    # itself passes to it
    (FutureWarning, "`broadcast_buffers` is deprecated"),
)


def quiet_foreign_notices() -> None:
    """Show only errors from :data:`FOREIGN_NOTICE_LOGGERS` and ignore
    :data:`FOREIGN_NOTICE_WARNINGS`: they are notes to another project's developers, which
    no user of this one can act on.

    Example::

        quiet_foreign_notices()  # first thing in an entry point's main()
    """
    for name in FOREIGN_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category, start in FOREIGN_NOTICE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)


def state_sparse_invariant_checks() -> None:
    """Say torch's sparse invariant checks' setting explicitly: off (torch's default) unless
    the process turned them on. torch's sparse optimizers (``Adagrad`` over
    ``EmbeddingBag(sparse=True)`` tables) otherwise warn at their first step that the checks
    are "implicitly disabled", about sparse tensors they build themselves.

    Example::

        state_sparse_invariant_checks()  # before the first step of a sparse optimizer
    """
    import torch  # here: the rest of this module serves entry points before they import torch

    checks = torch.sparse.check_sparse_tensor_invariants
    if not checks.is_enabled():
        checks.disable()


# The project's own loggers (the entry points log as ``__main__``).
OWN_LOGGERS: tuple[str, ...] = ("comera_rec", "__main__")


def setup_logging(level: int = logging.INFO) -> None:
    """Log the project's records at ``level`` and above (:data:`OWN_LOGGERS`) and other
    libraries' warnings and errors to stderr, one line each with the time, the level, the
    logger and, under ``torchrun``, the rank; then :func:`quiet_foreign_notices`.

    Other libraries stay at WARNING: at INFO TorchRec's planner alone writes about 90 lines
    per rank.

    The root logger's handlers are replaced (``force=True``): importing ``fbgemm_gpu`` (as
    torchrec does) installs a root handler at WARNING, after which a plain
    ``logging.basicConfig`` does nothing, and the entry points' INFO records were dropped.

    Args:
        level: the lowest level shown of the project's records.

    Example::

        setup_logging()  # first thing in an entry point's main()
    """
    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    where = f" [rank {rank}]" if rank is not None else ""
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s{where} %(levelname)s %(name)s: %(message)s", force=True
    )
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)
    quiet_foreign_notices()


# The lines libkineto (torch's profiler) writes straight to the process's stderr, from C++,
# each time a profile starts and stops, e.g.
# "USDT:2026-12-05 00:29:12 11488:11488 SyncActivityProfilerHandler.cpp:52] profiler_start"
# (and "STAGE:... Completed Stage: Warm Up" at some KINETO_LOG_LEVELs): notes for tracing
# tools, which no log level turns off.
PROFILER_BANNER = re.compile(rb"^(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


@contextmanager
def quiet_profiler_banners() -> Iterator[None]:
    """Drop the :data:`PROFILER_BANNER` lines the process writes to stderr inside the
    block. Stderr (file descriptor 2, which C++ writes to as well) is held in a temporary
    file meanwhile; every other line is written on when the block ends, in its order.
    Where file descriptor 2 cannot be duplicated (closed), the block runs unfiltered.

    Example::

        with quiet_profiler_banners(), torch.profiler.profile() as prof:
            step()
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # outside the except clause below: an error of the block is not chained to it
        saved = -1
    if saved < 0:
        yield
        return
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                kept = [line for line in held.read().splitlines(keepends=True) if not PROFILER_BANNER.match(line)]
                rest = memoryview(b"".join(kept))
                while rest:  # a pipe may take part of it at a time
                    rest = rest[os.write(2, rest) :]
    finally:
        os.close(saved)
