"""A checkpoint's files on disk: names, checksums, and the size-level completeness check.

The layout is described in :mod:`comera_rec.training.checkpoint`. :func:`is_complete` and
:func:`list_checkpoints` check sizes only (a stat per file);
:func:`comera_rec.training.checkpoint.checkpoint_problem` also verifies the checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Optional, Union

from comera_rec.training.dcp_state import SHARED_DIR

STEP_DIR_PATTERN = re.compile(r"^step_(\d{9})$")
TMP_PREFIX = ".tmp-"
SHARED_KEY = "__shared__"
"""Key of a rank file's skeleton of the shared state (its tensors are in ``shared/``)."""


class HashingWriter:
    """A binary file wrapper that hashes what is written through it."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush folder ``path``'s entries (creations, renames) to disk; errors are ignored."""
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


def step_of(path: Path) -> int:
    """The step of checkpoint folder ``path`` (named ``step_*``)."""
    return int(STEP_DIR_PATTERN.match(path.name).group(1))  # type: ignore[union-attr]


def incomplete_reason(path: Path) -> Optional[str]:
    """Why ``path`` is not a finished checkpoint (a stat per rank file, no read), or None."""
    if not STEP_DIR_PATTERN.match(path.name) or not path.is_dir():
        return "not a step_* folder"
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"no valid meta.json ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        return 'meta.json does not say "complete": true'
    sizes = meta.get("files") or {}
    if not isinstance(sizes, dict) or not isinstance(meta.get("sha256") or {}, dict):
        return 'meta.json has malformed "files" or "sha256" entries'
    try:
        world = int(meta.get("world_size", 1))
        for r in range(world):
            file = path / f"rank{r}.pt"
            if not file.is_file():
                return f"{file.name} is missing"
            if file.name in sizes and file.stat().st_size != int(sizes[file.name]):
                # cut short after it was written
                return f"{file.name} has {file.stat().st_size} bytes, meta.json says {sizes[file.name]} (cut short?)"
    except (TypeError, ValueError) as e:
        return f"meta.json has a malformed world_size or file size ({e})"
    shared = meta.get("shared")
    if shared is not None:
        if not isinstance(shared, dict) or not isinstance(shared.get("files"), dict):
            return 'meta.json has a malformed "shared" entry'
        for name, size in shared["files"].items():
            file = path / SHARED_DIR / name
            if not file.is_file():
                return f"{SHARED_DIR}/{name} is missing"
            if file.stat().st_size != int(size):
                return f"{SHARED_DIR}/{name} has {file.stat().st_size} bytes, meta.json says {size} (cut short?)"
    return None


def is_complete(path: Union[str, Path]) -> bool:
    """True if ``path`` is a finished checkpoint (named ``step_*`` with a valid meta.json).

    Only sizes are checked (a stat per rank file and per ``shared/`` file);
    :func:`checkpoint_problem` also verifies the checksums.
    """
    return incomplete_reason(Path(path)) is None


def list_checkpoints(root: Union[str, Path]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (sizes checked, not checksums)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=step_of)


def run_id_of(path: Path) -> Optional[str]:
    """The ``run_id`` in ``path/meta.json`` (None: none recorded, or no readable meta.json)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta.get("run_id") if isinstance(meta, dict) else None


def read_meta(path: Union[str, Path]) -> dict[str, Any]:
    """The ``meta.json`` of a complete checkpoint."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint")
    return json.loads((path / "meta.json").read_text())
