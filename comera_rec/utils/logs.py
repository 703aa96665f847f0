"""Logging set-up shared by the entry points."""

from __future__ import annotations

import logging
import os
import re
import warnings

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
