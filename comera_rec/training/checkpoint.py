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

The modules beside this one hold the parts: :mod:`comera_rec.training.checkpoint_files`
(names, checksums, the size-level check), :mod:`comera_rec.training.checkpoint_write`
(saving) and :mod:`comera_rec.training.checkpoint_shards` (local shards of the
per-process format). This module verifies and loads checkpoints, exports the model,
runs the command line and re-exports the rest.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from comera_rec.training.checkpoint_files import (  # noqa: F401
    SHARED_KEY,
    STEP_DIR_PATTERN,
    TMP_PREFIX,
    HashingWriter,
    checkpoint_name,
    file_sha256,
    fsync_dir,
    incomplete_reason,
    is_complete,
    list_checkpoints,
    read_meta,
    run_id_of,
    step_of,
)
from comera_rec.training.checkpoint_shards import (  # noqa: F401
    LOCAL_SHARDS,
    localize,
    restore_local,
    sharded_tensor_type,
)
from comera_rec.training.checkpoint_write import (  # noqa: F401
    NonFiniteStateError,
    all_finite,
    barrier,
    nonfinite_entries,
    refuse_nonfinite,
    save_checkpoint,
    split_shared,
    write_checkpoint,
)
from comera_rec.training.dcp_state import (  # noqa: F401
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

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A complete checkpoint cannot be read (corrupt file) or does not fit the run."""


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
    reason = incomplete_reason(path)
    if reason is not None:
        return f"incomplete: {reason}"
    meta = json.loads((path / "meta.json").read_text())
    expected = meta.get("sha256") or {}
    for r in range(int(meta.get("world_size", 1))):
        file = path / f"rank{r}.pt"
        if file.name not in expected:
            continue
        try:
            actual = file_sha256(file)
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
            actual = file_sha256(file)
        except OSError as e:
            return f"unreadable: {SHARED_DIR}/{name} ({e})"
        if actual != digest:
            return f"damaged: the SHA-256 of {SHARED_DIR}/{name} differs from the one in meta.json"
    return None


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
    candidates = sorted(
        (p for p in root.iterdir() if STEP_DIR_PATTERN.match(p.name) and p.is_dir()), key=step_of, reverse=True
    )
    skipped: list[str] = []
    for p in candidates:
        problem = checkpoint_problem(p)
        if problem is None:
            if skipped:
                log.warning(
                    "falling back to checkpoint %s (step %d): %d newer checkpoint(s) skipped",
                    p,
                    step_of(p),
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
    if expected is not None and file_sha256(file) != expected:
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
    if not STEP_DIR_PATTERN.match(path.name):
        found = latest_checkpoint(path)
        if found is None:
            raise SystemExit(f"{path}: no complete checkpoint")
        path = found
    state = export_model_state(path, args.out)
    print(f"{args.out}: {len(state)} tensors of the model at step {step_of(path)} ({path})")


if __name__ == "__main__":
    main()
