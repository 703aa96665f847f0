"""Checkpoints written in the background, so that training does not wait for the disk.

:func:`save_checkpoint_async` does on the calling thread only what must see the live
state: the collective NaN / inf refusal and a copy of every tensor into fresh CPU memory
(the training step changes the live tensors right after). Everything else, the files,
checksums, ``meta.json``, the atomic rename and pruning (:func:`checkpoint.write_checkpoint`,
the same code as a blocking save), runs in a thread. Its collectives (DCP's planning, the
barriers) go over a gloo process group of its own, so they never interleave with the
training step's collectives on the default group.

The guarantees of :mod:`comera_rec.training.checkpoint` hold unchanged: a process killed
while the thread writes leaves a ``.tmp-*`` folder that is never loaded, and the previous
checkpoints stay complete. What it costs: host memory for one copy of the state while a
save is in flight, and one save in flight at a time (a new save, the end of training and a
stop wait for the previous one).
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from comera_rec.training.checkpoint import (
    checkpoint_name,
    refuse_nonfinite,
    split_shared,
    write_checkpoint,
)
from comera_rec.training.dist import is_distributed

_groups: dict[int, Any] = {}


def checkpoint_group() -> Any:
    """The gloo group background saves use (made once per default group; collective the
    first time: every process must ask for it at the same point). None without a group."""
    if not is_distributed():
        return None
    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo")
    return _groups[key]


class Staging:
    """CPU buffers that one caller's background saves copy the state into, kept between
    saves: fresh memory costs a page fault per 4 KiB on first touch, most of a copy's time.
    Refilled when every key, local shape and dtype is the same as last time (a rank cut
    changes them: new buffers are made). Safe because the caller has one save in flight at a
    time and waits for it before the next snapshot; each caller keeps its own."""

    def __init__(self) -> None:
        self.signature: Optional[tuple] = None
        self.buffers: Optional[dict[str, Any]] = None


def _signature(flat: dict[str, Any]) -> tuple:
    """What the staging buffers must match: every key with its local shapes and dtype."""

    def local(value: Any) -> tuple:
        if hasattr(value, "local_shards"):  # ShardedTensor
            return tuple((tuple(s.tensor.shape), s.tensor.dtype) for s in value.local_shards())
        if hasattr(value, "to_local"):  # DTensor
            value = value.to_local()
        return ((tuple(value.shape), value.dtype),) if isinstance(value, torch.Tensor) else (type(value),)

    return tuple(sorted((k, local(v)) for k, v in flat.items()))


def snapshot(flat: dict[str, Any], staging: Optional[Staging] = None) -> dict[str, Any]:
    """A copy of every tensor of ``flat`` in CPU memory (ShardedTensors and DTensors keep
    their layout, their local data copied), into ``staging``'s buffers when given."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    staging = staging if staging is not None else Staging()
    signature = _signature(flat)
    if staging.buffers is None or staging.signature != signature:
        staging.buffers, staging.signature = _create_cpu_state_dict(flat), signature
    return _copy_state_dict(flat, staging.buffers)


class PendingCheckpoint:
    """A checkpoint being written by a background thread.

    Attributes:
        path: the folder it will have once complete.
        stall_s: seconds the caller was held (the refusal check and the copy).
    """

    def __init__(self, path: Path, stall_s: float) -> None:
        self.path = path
        self.stall_s = stall_s
        self.write_s: Optional[float] = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def _run(self, *args: Any) -> None:
        start = time.perf_counter()
        try:
            write_checkpoint(*args)
        except BaseException as e:  # re-raised by wait() on the training thread
            self._error = e
        self.write_s = time.perf_counter() - start

    def done(self) -> bool:
        """Whether the thread has finished (successfully or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is complete; returns its folder or raises what the
        writer raised."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path


def save_checkpoint_async(
    root: Union[str, Path],
    step: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    keep: int = 2,
    run_id: Optional[str] = None,
    shared: Optional[dict[str, Any]] = None,
    staging: Optional[Staging] = None,
) -> PendingCheckpoint:
    """:func:`~comera_rec.training.checkpoint.save_checkpoint` in a background thread
    (collective: every process calls it; the arguments are the same).

    Returns at once after the NaN / inf refusal and a CPU copy of the state; call
    :meth:`PendingCheckpoint.wait` before the next save and before exiting. ``staging``:
    buffers kept from this caller's previous save (see :class:`Staging`); None copies into
    fresh memory.

    Raises:
        NonFiniteStateError: as the blocking save, before anything is copied or written.

    Example::

        >>> pending = save_checkpoint_async(tmp / "ckpt", 10, {"step": 10}, {}, shared={"model": sd})  # doctest: +SKIP
        >>> pending.wait()  # doctest: +SKIP
    """
    start = time.perf_counter()
    root = Path(root)
    refuse_nonfinite(root / checkpoint_name(step), state, shared)
    group = checkpoint_group()
    parts = split_shared(shared)
    if parts is not None:
        parts = (parts[0], snapshot(parts[1], staging))
    with torch.no_grad():
        state = copy.deepcopy(state)  # counters, RNG streams, schedule: small
    pending = PendingCheckpoint(root / checkpoint_name(step), time.perf_counter() - start)
    args = (root, step, state, dict(meta), keep, run_id, parts, group)
    pending._thread = threading.Thread(target=pending._run, args=args, name=f"checkpoint-{step}", daemon=False)
    pending._thread.start()
    return pending
