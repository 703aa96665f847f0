"""Atomic, multi-process checkpoints that load without unpickling arbitrary objects.

Layout of a checkpoint root::

    checkpoints/
      step_000000100/          # complete: has meta.json
        meta.json              # step, world size, ranks of every TT module, "complete": true
        rank0.pt  rank1.pt     # each process's state (torch.save of tensors / plain types)
      .tmp-step_000000200/     # being written (or left by a crash): ignored

Every process writes its own file (model, optimisers, schedule, data position and its
RNG states) into a temporary folder; after a barrier rank 0 writes ``meta.json`` last
and renames the folder into place (``os.replace``, atomic on one file system). A crash at
any point leaves either the previous complete checkpoints or a ``.tmp-*`` folder that is
never loaded (and is removed by the next save). Files are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

_NAME = re.compile(r"^step_(\d{9})$")
TMP_PREFIX = ".tmp-"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimiser steps."""
    return f"step_{step:09d}"


def is_complete(path: Union[str, Path]) -> bool:
    """True if ``path`` is a finished checkpoint (named ``step_*`` with a valid meta.json)."""
    path = Path(path)
    if not _NAME.match(path.name) or not path.is_dir():
        return False
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        return False
    return all((path / f"rank{r}.pt").is_file() for r in range(int(meta.get("world_size", 1))))


def list_checkpoints(root: Union[str, Path]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))  # type: ignore[union-attr]


def latest_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The newest complete checkpoint under ``root``, or None.

    Example::

        >>> latest_checkpoint("runs/demo/checkpoints")  # doctest: +SKIP
        PosixPath('runs/demo/checkpoints/step_000000200')
    """
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: Union[str, Path],
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write this process's ``state`` into the checkpoint of ``step`` (collective).

    Every process of the group must call it. Rank 0 owns the folder and ``meta.json``.

    Args:
        root: folder holding all checkpoints of a run.
        step: optimiser steps taken; names the checkpoint.
        state: this process's state: tensors, numbers, strings, lists, tuples, dicts.
        meta: JSON-serialisable description (ranks of the TT modules, config, ...).
        keep: how many complete checkpoints to keep (older ones are deleted); 0 keeps all.

    Returns:
        The checkpoint folder.

    Example::

        >>> save_checkpoint(tmp / "ckpt", 10, {"model": model.state_dict()}, {})  # doctest: +SKIP
    """
    root = Path(root)
    rank = dist.get_rank() if _distributed() else 0
    world = dist.get_world_size() if _distributed() else 1
    final = root / checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    part = tmp / f"rank{rank}.pt.part"
    with part.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        meta = dict(meta, step=step, world_size=world, complete=True)
        meta_part = tmp / "meta.json.part"
        meta_part.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(meta_part, tmp / "meta.json")
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep > 0:
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def read_meta(path: Union[str, Path]) -> dict[str, Any]:
    """The ``meta.json`` of a complete checkpoint."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    return json.loads((path / "meta.json").read_text())


def load_checkpoint(path: Union[str, Path], rank: Optional[int] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read one process's state from a complete checkpoint (CPU tensors).

    Args:
        path: a checkpoint folder (see :func:`latest_checkpoint`).
        rank: whose file; this process's rank by default.

    Returns:
        ``(state, meta)``.

    Raises:
        FileNotFoundError: not a complete checkpoint.
        ValueError: the checkpoint was written by a different number of processes.
    """
    path = Path(path)
    meta = read_meta(path)
    world = dist.get_world_size() if _distributed() else 1
    if rank is None:
        rank = dist.get_rank() if _distributed() else 0
        if int(meta["world_size"]) != world:
            raise ValueError(
                f"{path} was written by {meta['world_size']} processes; this run has {world}"
            )
    state = torch.load(path / f"rank{rank}.pt", map_location="cpu", weights_only=True)
    return state, meta
