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
never loaded (and is removed by the next save). ``meta.json`` records the run id (see
:mod:`comera_rec.training.rundir`), and pruning to ``keep`` deletes only checkpoints of
the same run. ``meta.json`` also records the size of every rank file, so a file cut
short later (a full disk, a bad copy) makes the checkpoint incomplete, and its SHA-256: :func:`latest_checkpoint` verifies the rank files of the
candidates newest first and skips (with a warning naming it and why) every damaged one, so
a resume falls back to the newest good checkpoint; :func:`load_checkpoint` verifies the
file it reads again (damaged bytes asked for by name are a clear error) and logs the step
and folder it loaded. Files are read with ``torch.load(weights_only=True)``: no pickled
code runs.
Before anything is written every process checks its state for NaN / inf; a non-finite
value anywhere makes every process refuse the save (:class:`NonFiniteStateError`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from comera_rec.training import faults
from comera_rec.training.dist import is_distributed

_NAME = re.compile(r"^step_(\d{9})$")
TMP_PREFIX = ".tmp-"
log = logging.getLogger(__name__)


class NonFiniteStateError(FloatingPointError):
    """A state about to be checkpointed holds NaN or inf (the save is refused)."""


class CheckpointError(RuntimeError):
    """A complete checkpoint cannot be read (corrupt file) or does not fit the run."""


def nonfinite_entries(state: Any, prefix: str = "") -> list[str]:
    """Paths (``model.lin.cores.0``) of floating tensors in ``state`` holding NaN or inf.

    Walks dicts, lists and tuples; sharded tensors are checked shard by shard.
    """
    found: list[str] = []
    if isinstance(state, dict):
        for k, v in state.items():
            found += nonfinite_entries(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            found += nonfinite_entries(v, f"{prefix}.{i}" if prefix else str(i))
    elif hasattr(state, "local_shards"):  # torch.distributed ShardedTensor
        if any(not bool(torch.isfinite(s.tensor).all()) for s in state.local_shards() if s.tensor.is_floating_point()):
            found.append(prefix)
    elif isinstance(state, torch.Tensor) and (state.is_floating_point() or state.is_complex()):
        values = state.coalesce().values() if state.is_sparse else state
        if not bool(torch.isfinite(values).all()):
            found.append(prefix)
    return found


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


class _HashingWriter:
    """A binary file wrapper that hashes what is written through it."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


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


def _step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))  # type: ignore[union-attr]


def _incomplete_reason(path: Path) -> Optional[str]:
    """Why ``path`` is not a finished checkpoint (a stat per rank file, no read), or None."""
    if not _NAME.match(path.name) or not path.is_dir():
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
    return None


def is_complete(path: Union[str, Path]) -> bool:
    """True if ``path`` is a finished checkpoint (named ``step_*`` with a valid meta.json).

    Only sizes are checked (a stat per rank file); :func:`checkpoint_problem` also
    verifies the checksums.
    """
    return _incomplete_reason(Path(path)) is None


def checkpoint_problem(path: Union[str, Path]) -> Optional[str]:
    """Why the checkpoint ``path`` cannot be resumed from, or None when it is sound.

    Checks what :func:`is_complete` checks, then reads every rank file once and compares
    its SHA-256 with the one recorded in ``meta.json`` (files written without a recorded
    checksum are accepted on their size).

    Args:
        path: a ``step_*`` checkpoint folder.

    Returns:
        None, or a short reason: incomplete (no valid ``meta.json``, a rank file missing or
        of the wrong size), unreadable (an error reading a rank file), or damaged (a
        SHA-256 mismatch).

    Example::

        >>> checkpoint_problem("runs/demo/checkpoints/step_000000200")  # doctest: +SKIP
        'incomplete: rank0.pt is missing'
    """
    path = Path(path)
    reason = _incomplete_reason(path)
    if reason is not None:
        return f"incomplete: {reason}"
    meta = json.loads((path / "meta.json").read_text())
    expected = meta.get("sha256") or {}
    for r in range(int(meta.get("world_size", 1))):
        file = path / f"rank{r}.pt"
        if file.name not in expected:
            continue
        try:
            actual = _sha256(file)
        except OSError as e:
            return f"unreadable: {file.name} ({e})"
        if actual != expected[file.name]:
            return f"damaged: the SHA-256 of {file.name} differs from the one in meta.json"
    return None


def list_checkpoints(root: Union[str, Path]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (sizes checked, not checksums)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=_step_of)


def latest_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The newest sound checkpoint under ``root``, or None.

    Candidates (``step_*`` folders) are tried newest first; one that is incomplete,
    unreadable or damaged (see :func:`checkpoint_problem`) is skipped with a warning naming
    it and why, so a resume falls back to the newest good one. The rank files of the
    checkpoint returned are read once to verify them. Every process gets the same answer
    (all rank files are verified, not only this process's), without a collective.

    Args:
        root: folder holding all checkpoints of a run (need not exist).

    Returns:
        The checkpoint folder, or None when there is none or none is sound (a warning
        then says how many were skipped).

    Example::

        >>> latest_checkpoint("runs/demo/checkpoints")  # doctest: +SKIP
        PosixPath('runs/demo/checkpoints/step_000000200')
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = sorted((p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()), key=_step_of, reverse=True)
    skipped: list[str] = []
    for p in candidates:
        problem = checkpoint_problem(p)
        if problem is None:
            if skipped:
                log.warning(
                    "falling back to checkpoint %s (step %d): %d newer checkpoint(s) skipped",
                    p,
                    _step_of(p),
                    len(skipped),
                )
            return p
        log.warning("skipping checkpoint %s: %s", p, problem)
        skipped.append(p.name)
    if skipped:
        log.warning(
            "no usable checkpoint under %s: all %d step_* folders were skipped (%s)",
            root,
            len(skipped),
            ", ".join(skipped),
        )
    return None


def save_checkpoint(
    root: Union[str, Path],
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    keep: int = 2,
    run_id: Optional[str] = None,
) -> Path:
    """Write this process's ``state`` into the checkpoint of ``step`` (collective).

    Every process of the group must call it. Rank 0 owns the folder and ``meta.json``.

    Args:
        root: folder holding all checkpoints of a run.
        step: optimiser steps taken; names the checkpoint.
        state: this process's state: tensors, numbers, strings, lists, tuples, dicts.
        meta: JSON-serialisable description (ranks of the TT modules, config, ...).
        keep: how many complete checkpoints up to ``step`` to keep (older ones are deleted;
            newer ones, left by a run resumed from an earlier checkpoint, are not counted
            and stay until this run saves their step again); 0 keeps all. Only checkpoints
            of this run (the same ``run_id`` in their ``meta.json``) are counted and deleted.
        run_id: the run's id (:mod:`comera_rec.training.rundir`), recorded in ``meta.json``;
            None records none, and then only checkpoints without one are pruned. A folder of
            the same step left by another run is renamed aside (``step_N.run-<id>``), not
            deleted.

    Returns:
        The checkpoint folder.

    Raises:
        NonFiniteStateError: some process's state holds NaN or inf (nothing is written,
            on any process; the previous checkpoints stay as they are).

    Example::

        >>> save_checkpoint(tmp / "ckpt", 10, {"model": model.state_dict()}, {})  # doctest: +SKIP
    """
    root = Path(root)
    rank = dist.get_rank() if is_distributed() else 0
    world = dist.get_world_size() if is_distributed() else 1
    final = root / checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    bad = nonfinite_entries(state)
    bad_anywhere = len(bad) > 0
    if is_distributed():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        flag = torch.tensor([1.0 if bad else 0.0], device=device)
        dist.all_reduce(flag)
        bad_anywhere = float(flag) > 0
    if bad_anywhere:
        where = (
            f"rank {rank} has NaN/inf in {bad[:10]}" + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
            if bad
            else "another process has NaN/inf in its state"
        )
        raise NonFiniteStateError(f"refusing to write checkpoint {final}: {where}; the previous checkpoints are kept")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    part = tmp / f"rank{rank}.pt.part"
    with part.open("wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
        f.flush()
        os.fsync(f.fileno())
    (tmp / f"rank{rank}.sha256").write_text(writer.sha.hexdigest())
    os.replace(part, tmp / f"rank{rank}.pt")
    faults.maybe_kill(faults.KILL_IN_CHECKPOINT, step, rank, root)
    _barrier()
    if rank == 0:
        files = {f"rank{r}.pt": (tmp / f"rank{r}.pt").stat().st_size for r in range(world)}
        sha256 = {}
        for r in range(world):
            sidecar = tmp / f"rank{r}.sha256"
            sha256[f"rank{r}.pt"] = sidecar.read_text().strip()
            sidecar.unlink()
        meta = dict(meta, step=step, world_size=world, complete=True, files=files, sha256=sha256)
        if run_id is not None:
            meta["run_id"] = run_id
        meta_part = tmp / "meta.json.part"
        meta_part.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(meta_part, tmp / "meta.json")
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (after a resume): replace it
            other = _run_id_of(final)
            if other != run_id:  # another run's: never deleted, renamed out of the step_* names
                aside, n = root / f"{final.name}.run-{other or 'unknown'}", 1
                while aside.exists():
                    n += 1
                    aside = root / f"{final.name}.run-{other or 'unknown'}-{n}"
                os.replace(final, aside)
            else:
                shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep > 0:
            # only checkpoints up to this step count: a newer one left behind (damaged, after
            # a resume fell back past it) must not push the one just written out; and only
            # this run's: another run's checkpoints are never deleted
            ours = [p for p in list_checkpoints(root) if _step_of(p) <= step and _run_id_of(p) == run_id]
            for old in ours[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _run_id_of(path: Path) -> Optional[str]:
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
        pickle.UnpicklingError: the file holds an object other than tensors and plain
            types (it is refused, never run).
        CheckpointError: the file is corrupt (cut short, or its SHA-256 differs from the
            one in ``meta.json``).
    """
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no valid meta.json)")
    world = dist.get_world_size() if is_distributed() else 1
    if rank is None:
        rank = dist.get_rank() if is_distributed() else 0
        if int(meta["world_size"]) != world:
            raise ValueError(f"{path} was written by {meta['world_size']} processes; this run has {world}")
    file = path / f"rank{rank}.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: {path} is not a complete checkpoint")
    try:  # weights_only: safe to try before the checksum, no pickled code can run
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise  # weights_only refused a non-tensor object: its code never ran
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot be read as a checkpoint file ({e})") from e
    size = (meta.get("files") or {}).get(file.name)
    if size is not None and file.stat().st_size != int(size):
        raise CheckpointError(f"{file}: {file.stat().st_size} bytes, meta.json says {size} (cut short or replaced)")
    expected = (meta.get("sha256") or {}).get(file.name)
    if expected is not None and _sha256(file) != expected:
        raise CheckpointError(f"{file}: damaged (its SHA-256 differs from the one in meta.json)")
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a dict of states, got {type(state).__name__}")
    log.info("loaded checkpoint of step %s from %s (%s)", meta.get("step"), path, file.name)
    return state, meta


# ---------------------------------------------------------------------------- sharded state
# Under DistributedModelParallel, sharded tables (and their fused optimiser state) appear in
# state dicts as ShardedTensor objects, which a weights-only load refuses. Each process
# writes its own file, so it is enough to store the process's local shards as plain
# tensors and to copy them back into the live ShardedTensors after the model is sharded
# again the same way.

LOCAL_SHARDS = "__local_shards__"


def _sharded_tensor_type() -> type | None:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return ShardedTensor


def localize(obj: Any) -> Any:
    """``obj`` with every ShardedTensor replaced by ``{LOCAL_SHARDS: [local shard tensors]}``.

    Example::

        >>> localize({"w": torch.ones(2)})["w"]
        tensor([1., 1.])
    """
    sharded = _sharded_tensor_type()
    if sharded is not None and isinstance(obj, sharded):
        return {LOCAL_SHARDS: [shard.tensor.detach().clone() for shard in obj.local_shards()]}
    if isinstance(obj, dict):
        return {k: localize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(localize(v) for v in obj)
    return obj


@torch.no_grad()
def restore_local(live: Any, saved: Any, where: str = "state") -> Any:
    """Copy saved local shards into the ShardedTensors of ``live``; return ``saved`` with
    those entries replaced by the (now filled) live ShardedTensors, ready for a
    ``load_state_dict``.

    Raises:
        ValueError: when the saved shards do not match the live ones (another sharding).
    """
    sharded = _sharded_tensor_type()
    if isinstance(saved, dict) and LOCAL_SHARDS in saved:
        if sharded is None or not isinstance(live, sharded):
            raise ValueError(
                f"{where}: the checkpoint holds shards of a sharded tensor, the model a plain one; "
                "resume with the same sharding (embedding_optim.sharding_type) and world size"
            )
        shards = live.local_shards()
        stored = saved[LOCAL_SHARDS]
        if len(shards) != len(stored) or any(a.tensor.shape != b.shape for a, b in zip(shards, stored)):
            raise ValueError(
                f"{where}: the checkpoint's local shards {[tuple(t.shape) for t in stored]} do not "
                f"match this process's {[tuple(s.tensor.shape) for s in shards]}; resume with the same "
                "sharding and world size"
            )
        for shard, tensor in zip(shards, stored):
            shard.tensor.copy_(tensor)
        return live
    if isinstance(saved, dict) and isinstance(live, dict):
        return {k: restore_local(live.get(k), v, f"{where}.{k}") for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        return type(saved)(restore_local(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(live, saved)))
    return saved
