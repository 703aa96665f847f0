"""Logging set-up shared by the entry points."""

from __future__ import annotations

import logging
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
