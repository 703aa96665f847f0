"""Graceful stops: SIGINT / SIGTERM end a run after the current step, with a checkpoint.

A scheduler that pre-empts a job sends SIGTERM (torchrun forwards it to every worker);
Ctrl-C sends SIGINT. While :meth:`Trainer.fit` runs, :class:`StopSignals` turns the first
of either into a flag that the loop reads between steps; every process agrees on it (one
all-reduce shared with the "still has a batch" flag), a checkpoint is written and
:class:`TrainingStopped` (a ``SystemExit``) ends the process with the shell's code for
that signal (130 for SIGINT, 143 for SIGTERM). A second signal aborts at once: the
first one puts the default handlers back.

Example::

    >>> with StopSignals() as stop:  # doctest: +SKIP
    ...     for step in range(100):
    ...         if stop.signum:
    ...             break
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Optional

logger = logging.getLogger(__name__)

# the signals that stop a run gracefully
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, ``SIGINT`` for 2, ``signal N`` for others."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class TrainingStopped(SystemExit):
    """The run stopped on a signal after checkpointing; exits with ``128 + signum``.

    A ``SystemExit``: an entry point that does not catch it exits with that code, the
    convention of shells and schedulers for a process ended by a signal.

    Args:
        signum: the signal that stopped the run.
        step: the last optimiser step done.
        checkpoint: the checkpoint written at the stop (None if none could be written).
        message: the log line, also the exception's text.

    Attributes:
        code: ``128 + signum`` (SystemExit's exit status).
    """

    def __init__(self, signum: int, step: int, checkpoint: Any, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """Context manager: SIGINT / SIGTERM set :attr:`signum` instead of ending the process.

    The handlers are installed on entry and the previous ones put back on exit. The first
    signal restores the default handlers, so a second one aborts at once (even inside a
    collective that never returns). Off the main thread, where Python cannot install
    handlers, nothing is installed and :attr:`signum` stays 0.

    Args:
        signals: the signals to catch (default :data:`STOP_SIGNALS`).

    Attributes:
        signum: the first signal received, 0 while none.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            # None: a handler set from C, which Python cannot re-install
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum:
            return
        self.signum = signum
        for sig in self._previous:
            signal.signal(sig, signal.SIG_DFL)  # a second signal ends the process now
        logger.warning(
            "%s received: stopping after this step with a checkpoint (send it again to abort now)", signal_name(signum)
        )
