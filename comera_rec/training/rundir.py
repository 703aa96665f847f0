"""One run per run directory: an exclusive lock, no fresh start over another run, a run id.

A run takes an exclusive ``fcntl.flock`` on ``run_dir/run.lock`` for its whole life
(rank 0 takes it for all processes of a torchrun group: the processes of one run cannot
each hold an exclusive lock on one file, and a second launch's rank 0 tries the same file
through the same shared file system as the checkpoints). The file records the holder's
pid, host and start time, so a second launch into the same folder fails at once with
:class:`RunDirLockedError` naming the folder and the holder. The lock is released by
:meth:`RunDir.release` (``Trainer.close``) and by the operating system when the process
dies, so a lock file left behind by a killed run never blocks the next one.

A fresh start (no ``--resume``, not a torchrun restart) into a folder that holds
checkpoints, a ``log.jsonl`` or a ``summary.json`` raises :class:`ExistingRunError` unless
``overwrite`` is set, which moves the
folder's contents (all but the lock file) into a new sibling ``<run_dir>.old-<timestamp>``:
nothing is deleted.

Every run has a run id (a uuid4 hex chosen by rank 0 at a fresh start and broadcast; on a
resume, the id recorded in the checkpoint's ``meta.json``). Checkpoints record it, and
pruning to ``keep`` only ever deletes checkpoints of the same run
(:func:`comera_rec.training.checkpoint.save_checkpoint`).

Example::

    >>> run = open_run_dir(Path("runs/demo"), resume_from=None, resume=False)  # doctest: +SKIP
    >>> run.run_id  # doctest: +SKIP
    '3f0c...'
    >>> run.release()  # doctest: +SKIP
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from comera_rec.training.dist import is_distributed, restart_count

LOCK_NAME = "run.lock"
log = logging.getLogger(__name__)


class RunDirLockedError(RuntimeError):
    """Another process holds the run directory's lock (a second launch into the same folder)."""


class ExistingRunError(FileExistsError):
    """A fresh start into a run directory that holds another run's checkpoints."""


@dataclass
class RunLock:
    """An exclusive ``flock`` on ``run_dir/run.lock``, held until :meth:`release`.

    Attributes:
        path: the lock file.
        fd: its open descriptor (None once released).
    """

    path: Path
    fd: Optional[int] = None

    def release(self) -> None:
        """Unlock and close the lock file (idempotent). The file itself stays."""
        if self.fd is None:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None


def _holder(path: Path) -> str:
    """Who holds the lock, as recorded in the lock file ("pid 123 on host x since ...")."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "a process that recorded no pid"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if "started" in info else "?"
    return f"pid {info.get('pid')} on host {info.get('host', '?')} (since {since})"


def lock_run_dir(run_dir: Path) -> RunLock:
    """Take the exclusive lock of ``run_dir`` without waiting (creates the folder).

    Args:
        run_dir: the run directory (trainer.run_dir).

    Returns:
        The held lock; call :meth:`RunLock.release` when the run ends.

    Raises:
        RunDirLockedError: another process holds it; the message names the folder and the
            holder's pid and host.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        raise RunDirLockedError(
            f"trainer.run_dir={str(run_dir)!r} is in use by another run: {_holder(path)} holds {path}. "
            f"Wait for that run to end (or stop it), or choose another trainer.run_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
    return RunLock(path, fd)


def _step_folders(run_dir: Path) -> list[Path]:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith("step_") and p.is_dir())


def move_aside(run_dir: Path) -> Path:
    """Move everything in ``run_dir`` except the lock file into a new sibling folder
    ``<run_dir>.old-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when taken); nothing is deleted.

    Args:
        run_dir: the run directory, locked by this process.

    Returns:
        The folder now holding the old run.
    """
    run_dir = Path(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while True:
        try:
            target.mkdir()
            break
        except FileExistsError:
            n += 1
            target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    for entry in sorted(run_dir.iterdir()):
        if entry.name != LOCK_NAME:
            os.replace(entry, target / entry.name)
    return target


# what a finished or running run leaves in its run_dir besides checkpoints (empty ones, e.g.
# of a run that failed before its first record, hold nothing to lose)
RUN_RECORDS = ("log.jsonl", "summary.json")


def check_fresh_start(run_dir: Path, overwrite: bool) -> Optional[Path]:
    """Refuse a fresh start into ``run_dir`` when it holds another run's checkpoints, log or
    summary, or move them aside.

    Args:
        run_dir: the run directory (locked by this process).
        overwrite: move the old run aside (:func:`move_aside`) instead of refusing.

    Returns:
        The folder the old run was moved to, or None when there was nothing to move.

    Raises:
        ExistingRunError: checkpoints are there and ``overwrite`` is off; the message names
            ``--resume``, another folder and ``trainer.overwrite=true``.
    """
    found = _step_folders(run_dir)
    # a run without checkpoints (checkpoint_at_end=false) still leaves its log and summary,
    # which a fresh start would overwrite
    records = [name for name in RUN_RECORDS if (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0]
    if not found and not records:
        return None
    if not overwrite:
        what = (
            f"{len(found)} checkpoint(s) of another run (newest {found[-1].name})"
            if found
            else f"another run's {' and '.join(records)}"
        )
        raise ExistingRunError(
            f"trainer.run_dir={str(run_dir)!r} already holds {what}, and this is a fresh start. Pass --resume "
            f"(trainer.resume=true) to continue that run, choose a new trainer.run_dir, or set "
            f"trainer.overwrite=true to move the old run aside into {run_dir.name}.old-<timestamp> "
            f"(nothing is deleted)"
        )
    target = move_aside(run_dir)
    log.warning("trainer.overwrite: moved the previous run in %s aside to %s", run_dir, target)
    return target


def run_id_of(checkpoint: Optional[Path]) -> Optional[str]:
    """The run id recorded in a checkpoint's ``meta.json`` (None: none recorded or unreadable)."""
    if checkpoint is None:
        return None
    try:
        meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    run_id = meta.get("run_id") if isinstance(meta, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


@dataclass
class RunDir:
    """A run directory opened by :func:`open_run_dir`.

    Attributes:
        path: the run directory.
        run_id: the run's id, the same on every process.
        lock: the held lock (rank 0 only; None elsewhere).
        moved_to: where ``overwrite`` moved the previous run, or None.
    """

    path: Path
    run_id: str
    lock: Optional[RunLock] = None
    moved_to: Optional[Path] = field(default=None)

    def release(self) -> None:
        """Release the lock (idempotent; a no-op on ranks other than 0)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def open_run_dir(run_dir: Path, resume_from: Optional[Path], resume: bool, overwrite: bool = False) -> RunDir:
    """Lock ``run_dir``, check a fresh start does not land on another run, agree on the run id.

    Collective under torch.distributed: every process calls it; rank 0 takes the lock,
    checks and picks the id, then broadcasts the outcome, so every process raises the same
    error or gets the same run id.

    Args:
        run_dir: the run directory (trainer.run_dir).
        resume_from: the checkpoint this run resumes from (None: starts afresh).
        resume: trainer.resume was asked for (a torchrun restart counts as one): then no
            fresh-start check is made, even when no checkpoint was found
            (``resume_missing_ok``).
        overwrite: trainer.overwrite: on a fresh start, move another run's files aside
            instead of refusing.

    Returns:
        The opened run directory; call :meth:`RunDir.release` at the end of the run.

    Raises:
        RunDirLockedError: another process holds the lock of ``run_dir``.
        ExistingRunError: a fresh start into a folder holding checkpoints, without overwrite.
    """
    run_dir = Path(run_dir)
    rank = dist.get_rank() if is_distributed() else 0
    lock: Optional[RunLock] = None
    outcome: list[Any] = [None, None, None, None]  # error type name, message, run id, moved to
    if rank == 0:
        try:
            lock = lock_run_dir(run_dir)
            moved = None
            if not (resume or restart_count() > 0):
                moved = check_fresh_start(run_dir, overwrite)
            run_id = run_id_of(resume_from) if resume_from is not None else None
            if resume_from is not None and run_id is None:
                log.warning(
                    "checkpoint %s records no run id (written before run ids): this run gets a new one, "
                    "and checkpoints without one are never pruned",
                    resume_from,
                )
            outcome = [None, None, run_id or uuid.uuid4().hex, str(moved) if moved else None]
        except (RunDirLockedError, ExistingRunError) as e:
            if lock is not None:
                lock.release()
                lock = None
            outcome = [type(e).__name__, str(e), None, None]
    if is_distributed():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        dist.broadcast_object_list(outcome, src=0, device=device)
    kind, message, run_id, moved_to = outcome
    if kind is not None:
        raise {"RunDirLockedError": RunDirLockedError, "ExistingRunError": ExistingRunError}[kind](message)
    return RunDir(run_dir, run_id, lock, Path(moved_to) if moved_to else None)
