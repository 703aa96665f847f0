"""Fault injection for the reliability tests (a test hook, off unless its variable is set).

Two environment variables make one process SIGKILL itself once, so tests can prove that
elastic restarts and interrupted checkpoints lose nothing:

* ``COMERA_FAULT_KILL_AT_STEP=K``: the process of rank ``COMERA_FAULT_KILL_RANK``
  (default 0) kills itself right after optimiser step ``K``, before that step's log
  record, evaluation or checkpoint.
* ``COMERA_FAULT_KILL_IN_CHECKPOINT=K``: while the checkpoint of step ``K`` is written,
  that process kills itself after its ``rankR.pt`` is in the temporary folder and before
  ``meta.json`` is written and the folder renamed into place.

Each fault fires once per run: before killing, the process creates a marker file
(``.fault-<point>-<K>-rank<R>``) in the run's folder, and a marker that exists disables
the fault, so the attempt that ``torchrun --max-restarts`` starts next runs through.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Union

KILL_AT_STEP = "COMERA_FAULT_KILL_AT_STEP"
KILL_IN_CHECKPOINT = "COMERA_FAULT_KILL_IN_CHECKPOINT"
KILL_RANK = "COMERA_FAULT_KILL_RANK"


def maybe_kill(variable: str, step: int, rank: int, marker_dir: Union[str, Path]) -> None:
    """SIGKILL this process if ``variable`` names ``step`` for this ``rank`` (once per run).

    Args:
        variable: :data:`KILL_AT_STEP` or :data:`KILL_IN_CHECKPOINT`.
        step: the current optimiser step.
        rank: this process's rank.
        marker_dir: where the fire-once marker lives (the run or checkpoint folder).
    """
    wanted = os.environ.get(variable)
    if not wanted or int(wanted) != step or int(os.environ.get(KILL_RANK, "0")) != rank:
        return
    marker = Path(marker_dir) / f".fault-{variable.lower()}-{step}-rank{rank}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    with marker.open("w") as f:
        f.write("fired\n")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
