"""Atomic, multi-process checkpoints that load without unpickling arbitrary objects.

Layout of a checkpoint root::

    checkpoints/
      step_000000100/          # complete: has meta.json
        meta.json              # step, world size, ranks of every TT module, sizes and
                               # SHA-256 of every file, "complete": true
        rank0.pt  rank1.pt     # each process's own state (torch.save of tensors / plain types)
        shared/                # the global tensors, on torch.distributed.checkpoint (DCP):
          .metadata            #   every tensor's global size and where its chunks are
          __0_0.distcp  ...    #   the chunks each process wrote
      .tmp-step_000000200/     # being written (or left by a crash): ignored

Every process writes its own rank file (counters, RNG streams, schedule: what may differ
between processes) and, through DCP, its part of the *shared* state handed to
:func:`save_checkpoint` (model, optimiser state: replicated tensors are written once, by
one process; sharded tables as chunks with their global offsets), all into a temporary
folder; after a barrier rank 0 writes ``meta.json`` last and renames the folder into place
(``os.replace``, atomic on one file system). A crash at any point leaves either the
previous complete checkpoints or a ``.tmp-*`` folder that is never loaded (and is removed
by the next save). ``meta.json`` records the run id (see :mod:`comera_rec.training.rundir`),
and pruning to ``keep`` deletes only checkpoints of the same run. ``meta.json`` also
records the size and SHA-256 of every file (rank files and DCP files), so a file cut short
later (a full disk, a bad copy) makes the checkpoint incomplete: :func:`latest_checkpoint`
verifies the candidates newest first and skips (with a warning naming it and why) every
damaged one, so a resume falls back to the newest good checkpoint; :func:`load_checkpoint`
verifies the files it reads again (damaged bytes asked for by name are a clear error) and
logs the step and folder it loaded. Rank files are read with
``torch.load(weights_only=True)``, DCP metadata with an allow-list unpickler and DCP
tensors weights-only (:mod:`comera_rec.training.dcp_state`): no pickled code runs.
Before anything is written every process checks its state for NaN / inf; a non-finite
value anywhere makes every process refuse the save (:class:`NonFiniteStateError`).

Because the shared state is stored with global shapes and offsets, a checkpoint written by
N processes loads into M (the engine's resume reshards through DCP) and
:func:`load_checkpoint` / :func:`export_model_state` give the whole model in one process
without a process group.
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
from comera_rec.training.dcp_state import (
    SHARED_DIR,
    complete_skeleton,
    fill_skeleton,
    load_whole,
    placeholders,
    save_shared,
    split_tensors,
    tensor_shapes,
)
from comera_rec.training.dist import is_distributed

_NAME = re.compile(r"^step_(\d{9})$")
TMP_PREFIX = ".tmp-"
SHARED_KEY = "__shared__"
"""Key of a rank file's skeleton of the shared state (its tensors are in ``shared/``)."""
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
    if isinstance(state, torch.Tensor) or hasattr(state, "local_shards"):
        tensors = [s.tensor for s in state.local_shards()] if hasattr(state, "local_shards") else [state]
        if not all(_all_finite(t) for t in tensors if t.is_floating_point() or t.is_complex()):
            found.append(prefix)
    elif isinstance(state, dict):
        for k, v in state.items():
            found += nonfinite_entries(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            found += nonfinite_entries(v, f"{prefix}.{i}" if prefix else str(i))
    return found


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN / inf in ``t``. A finite sum proves it (NaN and inf propagate through a sum):
    one vectorised reduction in ``t``'s own dtype, ~20x faster than ``isfinite(t).all()``
    (its mask) or a float64 sum on this host. Only when the sum is not finite (a NaN, an
    inf, or finite values whose sum overflows) are the entries checked one by one."""
    values = t.coalesce().values() if t.is_sparse else t
    if values.numel() == 0:
        return True
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())


def _barrier(group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group=group)


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
    return _incomplete_reason(Path(path)) is None


def checkpoint_problem(path: Union[str, Path]) -> Optional[str]:
    """Why the checkpoint ``path`` cannot be resumed from, or None when it is sound.

    Checks what :func:`is_complete` checks, then reads every rank file and every file of
    ``shared/`` once and compares its SHA-256 with the one recorded in ``meta.json`` (files
    written without a recorded checksum are accepted on their size).

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
    return _shared_problem(path, meta)


def _shared_problem(path: Path, meta: dict[str, Any]) -> Optional[str]:
    """Why the DCP files of ``path`` do not match the checksums in ``meta``, or None."""
    shared = meta.get("shared") or {}
    for name, digest in (shared.get("sha256") or {}).items():
        file = path / SHARED_DIR / name
        try:
            actual = _sha256(file)
        except OSError as e:
            return f"unreadable: {SHARED_DIR}/{name} ({e})"
        if actual != digest:
            return f"damaged: the SHA-256 of {SHARED_DIR}/{name} differs from the one in meta.json"
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
    shared: Optional[dict[str, Any]] = None,
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
        shared: the global state, the same structure on every process (None on all or on
            none): its tensors must be replicated (equal on every process; one copy is
            written) or ShardedTensors (each process writes its shards); they go into
            ``shared/`` through DCP, the rest (its skeleton) into the rank files. A run
            with another number of processes or another sharding can read it back.

    Returns:
        The checkpoint folder.

    Raises:
        NonFiniteStateError: some process's state holds NaN or inf (nothing is written,
            on any process; the previous checkpoints stay as they are).

    Example::

        >>> save_checkpoint(tmp / "ckpt", 10, {"model": model.state_dict()}, {})  # doctest: +SKIP
    """
    refuse_nonfinite(Path(root) / checkpoint_name(step), state, shared)
    return write_checkpoint(root, step, state, meta, keep, run_id, split_shared(shared))


def split_shared(shared: Optional[dict[str, Any]]) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
    """``shared`` as (skeleton, flat tensors by key) for DCP; None stays None."""
    if shared is None:
        return None
    skeleton, flat = {}, {}
    for key, value in shared.items():
        skeleton[key], part_flat = split_tensors(value, str(key))
        flat.update(part_flat)
    return skeleton, flat


def refuse_nonfinite(final: Path, state: dict[str, Any], shared: Optional[dict[str, Any]]) -> None:
    """Raise :class:`NonFiniteStateError` on every process when any process's state holds
    NaN / inf (collective), before anything of checkpoint ``final`` is written."""
    rank = dist.get_rank() if is_distributed() else 0
    bad = nonfinite_entries(state) + (nonfinite_entries(shared) if shared is not None else [])
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


def write_checkpoint(
    root: Union[str, Path],
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
    run_id: Optional[str],
    shared: Optional[tuple[dict[str, Any], dict[str, Any]]],
    group: Any = None,
) -> Path:
    """The writing half of :func:`save_checkpoint` (collective over ``group``, the default
    group when None): files into the temporary folder, checksums, ``meta.json``, the atomic
    rename, pruning. ``shared`` is :func:`split_shared`'s (skeleton, flat tensors). Runs in a
    background thread for :func:`comera_rec.training.async_save.save_checkpoint_async`, with
    a process group of its own."""
    root = Path(root)
    rank = dist.get_rank() if is_distributed() else 0
    world = dist.get_world_size() if is_distributed() else 1
    final = root / checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        if shared is not None:
            (tmp / SHARED_DIR).mkdir()
    _barrier(group)
    if shared is not None:
        # tensors through DCP (one copy of replicated ones, shards with their offsets); each
        # process hashes the DCP files it wrote, rank 0 collects the sidecars below
        skeleton, flat = shared
        written = save_shared(tmp / SHARED_DIR, flat, group)
        sums = {f.name: [f.stat().st_size, _sha256(f)] for f in written}
        (tmp / f"shared{rank}.sha256.json").write_text(json.dumps(sums))
        state = dict(state, **{SHARED_KEY: skeleton})
    part = tmp / f"rank{rank}.pt.part"
    with part.open("wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
        f.flush()
        os.fsync(f.fileno())
    (tmp / f"rank{rank}.sha256").write_text(writer.sha.hexdigest())
    os.replace(part, tmp / f"rank{rank}.pt")
    faults.maybe_kill(faults.KILL_IN_CHECKPOINT, step, rank, root)
    _barrier(group)
    if rank == 0:
        files = {f"rank{r}.pt": (tmp / f"rank{r}.pt").stat().st_size for r in range(world)}
        sha256 = {}
        for r in range(world):
            sidecar = tmp / f"rank{r}.sha256"
            sha256[f"rank{r}.pt"] = sidecar.read_text().strip()
            sidecar.unlink()
        meta = dict(meta, step=step, world_size=world, complete=True, files=files, sha256=sha256)
        if shared is not None:
            sums = {}
            for r in range(world):
                sidecar = tmp / f"shared{r}.sha256.json"
                sums.update(json.loads(sidecar.read_text()))
                sidecar.unlink()
            meta["shared"] = {
                "files": {name: size for name, (size, _) in sorted(sums.items())},
                "sha256": {name: digest for name, (_, digest) in sorted(sums.items())},
            }
        if run_id is not None:
            meta["run_id"] = run_id
        meta_part = tmp / "meta.json.part"
        meta_part.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(meta_part, tmp / "meta.json")
        if shared is not None:
            _fsync_dir(tmp / SHARED_DIR)
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
    _barrier(group)
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


def load_checkpoint(
    path: Union[str, Path], rank: Optional[int] = None, shared: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read one process's state from a complete checkpoint (CPU tensors).

    A checkpoint with a shared part (``shared/``, the model and optimiser state on DCP)
    can be read by any number of processes: a process whose rank the checkpoint has no
    file for reads rank ``rank % world_size``'s (the per-process state of the writing run
    is the same on every process, except the RNG streams). Older checkpoints without a
    shared part hold each process's local shards and need the same world size.

    Args:
        path: a checkpoint folder (see :func:`latest_checkpoint`).
        rank: whose rank file; this process's rank by default.
        shared: read the shared tensors whole (sharded tables gathered, in this process
            alone, no collective) and merge them into the state; False leaves the shared
            part's skeleton under :data:`SHARED_KEY` for a sharded load (the engine's).

    Returns:
        ``(state, meta)``.

    Raises:
        FileNotFoundError: not a complete checkpoint.
        ValueError: a checkpoint without a shared part written by another number of
            processes.
        pickle.UnpicklingError: a file holds an object other than tensors and plain types
            (it is refused, never run).
        CheckpointError: a file is corrupt (cut short, or its SHA-256 differs from the one
            in ``meta.json``).
    """
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no valid meta.json)")
    world = dist.get_world_size() if is_distributed() else 1
    saved_world = int(meta.get("world_size", 1))
    if rank is None:
        rank = dist.get_rank() if is_distributed() else 0
        if saved_world != world:
            if "shared" not in meta:
                raise ValueError(
                    f"{path} was written by {saved_world} processes in the per-process format (local "
                    f"shards, no shared/ folder); this run has {world}: resume it with {saved_world}"
                )
            rank = rank % saved_world
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
    if shared and SHARED_KEY in state:
        problem = _shared_problem(path, meta)
        if problem is not None:
            raise CheckpointError(f"{path}: {problem}")
        try:
            # each rank file names its own part of TorchRec's fused state: complete it
            skeleton = complete_skeleton(state.pop(SHARED_KEY), tensor_shapes(path / SHARED_DIR))
            flat = load_whole(path / SHARED_DIR, placeholders(skeleton))
        except pickle.UnpicklingError:
            raise
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path / SHARED_DIR}: cannot be read ({type(e).__name__}: {e})") from e
        state.update(fill_skeleton(skeleton, flat))
    log.info("loaded checkpoint of step %s from %s (%s)", meta.get("step"), path, file.name)
    return state, meta


def export_model_state(path: Union[str, Path], out: Optional[Union[str, Path]] = None) -> dict[str, torch.Tensor]:
    """The trained model of a checkpoint as one plain state dict, in one process.

    Dense tables come back whole (gathered from their shards), TT cores and controllers
    at the ranks they were saved with: load it into the model built from the run's config
    after :func:`comera_rec.rank.truncation.resize_to_state_dict`. No process group is
    needed, whatever number of processes wrote the checkpoint.

    Args:
        path: a ``step_*`` checkpoint folder.
        out: where to ``torch.save`` the state dict too (loadable with
            ``torch.load(weights_only=True)``); None writes nothing.

    Returns:
        The model's state dict (CPU tensors).

    Raises:
        ValueError: the checkpoint has no shared part and was written by several
            processes (its rank files hold only local shards).

    Example::

        >>> sd = export_model_state("runs/x/checkpoints/step_000000100")  # doctest: +SKIP
        >>> resize_to_state_dict(model, sd); model.load_state_dict(sd)  # doctest: +SKIP
    """
    path = Path(path)
    meta = read_meta(path)
    if "shared" not in meta and int(meta.get("world_size", 1)) != 1:
        raise ValueError(f"{path}: written by {meta['world_size']} processes without a shared/ part")
    model = load_checkpoint(path, rank=0)[0]["model"]
    state = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    if out is not None:
        out = Path(out)
        part = out.with_name(out.name + ".part")
        torch.save(state, part)
        os.replace(part, out)
    return state


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m comera_rec.training.checkpoint export CHECKPOINT OUT.pt``: see
    :func:`export_model_state`.

    Args:
        argv: the arguments (``sys.argv[1:]`` by default).
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m comera_rec.training.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write a checkpoint's model as one plain state dict (torch.save)")
    export.add_argument("checkpoint", type=Path, help="a step_* folder, or a checkpoints/ folder (its newest)")
    export.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    path = args.checkpoint
    if not _NAME.match(path.name):
        found = latest_checkpoint(path)
        if found is None:
            raise SystemExit(f"{path}: no complete checkpoint")
        path = found
    state = export_model_state(path, args.out)
    print(f"{args.out}: {len(state)} tensors of the model at step {_step_of(path)} ({path})")


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


if __name__ == "__main__":
    main()
