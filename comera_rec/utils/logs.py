"""Logging set-up shared by the entry points."""

from __future__ import annotations

import logging

# Loggers whose warnings speak to another project's developers, not to a user of this one.
FOREIGN_NOTICE_LOGGERS: tuple[str, ...] = (
    # torch's notice, once per process (so once per rank), that torchrec's modules call
    # `is_fx_tracing`, which cannot tell fx tracing from torch.export
    "torch.fx._symbolic_trace",
)


def quiet_foreign_notices() -> None:
    """Show only errors from :data:`FOREIGN_NOTICE_LOGGERS`: their warnings are notes to
    another project's developers, which no user of this one can act on.

    Example::

        quiet_foreign_notices()  # first thing in an entry point's main()
    """
    for name in FOREIGN_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
