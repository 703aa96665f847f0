"""The CPU-side host-sync check: :func:`forbid_host_syncs` rejects operators a CUDA graph
capture cannot hold (re-exported by :mod:`comera_rec.training.cuda_graph`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncError(RuntimeError):
    """An operation that synchronises with the host ran where :func:`forbid_host_syncs` forbids it."""

    __module__ = "comera_rec.training.cuda_graph"  # its public home (re-exported there): tracebacks and pickles name it


# operator -> why it cannot be captured
SYNC_OPS = {
    "_local_scalar_dense": "reads a value on the host (.item(), bool(), int() or float() of a tensor)",
    "_unique": "torch.unique: output shape from the data",
    "_unique2": "torch.unique: output shape from the data",
    "unique_dim": "torch.unique: output shape from the data",
    "unique_consecutive": "torch.unique_consecutive: output shape from the data",
    "nonzero": "nonzero: output shape from the data",
    "masked_select": "masked_select: output shape from the data",
    "bincount": "bincount: output length from the largest value",
    "equal": "torch.equal returns a Python bool (a sync)",
    "is_nonzero": "a tensor's truth value read on the host",
    "lift_fresh": "a tensor made from Python data (torch.tensor): a host-to-device copy on a GPU",
    "lift_fresh_copy": "a tensor made from Python data (torch.tensor): a host-to-device copy on a GPU",
}


_forbidding = 0  # depth of forbid_host_syncs blocks (the stand-in for a capture)


class ForbidHostSyncs(TorchDispatchMode):
    """The dispatch mode behind :func:`forbid_host_syncs`: raises HostSyncError on a host sync."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        why = SYNC_OPS.get(name)
        if func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            # what repeat_interleave(x, repeats_tensor) decomposes to
            why = "repeat_interleave with tensor repeats and no output_size: output length from the data"
        if why is None and name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                why = "boolean-mask indexing: output shape from the data"
        if why is not None:
            raise HostSyncError(f"{func}: {why}; not capturable in a CUDA graph")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_syncs() -> Iterator[None]:
    """Raise :class:`HostSyncError` on operators that synchronise with the host or size
    their output from data, inside the block (forward and backward).

    A CPU-side check of what a CUDA graph capture would reject, by the dispatched ATen
    operators: ``.item()`` and truth values, ``unique``, ``nonzero``, ``bincount``,
    boolean-mask indexing, ``repeat_interleave`` without ``output_size``, tensors made
    from Python data. It cannot see host reads that dispatch no operator
    (``tolist()`` of a CPU tensor), device copies (everything is on the CPU here), or
    syncs inside a kernel's own implementation.

    Example::

        >>> with forbid_host_syncs():  # doctest: +ELLIPSIS
        ...     torch.ones(3).sum().item()
        Traceback (most recent call last):
        ...
        comera_rec.training.cuda_graph.HostSyncError: aten._local_scalar_dense.default: reads a value ...
    """
    global _forbidding
    _forbidding += 1
    try:
        with ForbidHostSyncs():
            yield
    finally:
        _forbidding -= 1


def capturing() -> bool:
    """Whether the code running now is being captured: inside a CUDA graph capture on the
    current stream, or inside :func:`forbid_host_syncs` (the CPU stand-in's replays). Code
    that reads tensors on the host to check them (input validation) skips that here; the
    engine checks each batch on the host before a captured step runs it.

    Example::

        >>> capturing()
        False
        >>> with forbid_host_syncs():
        ...     capturing()
        True
    """
    if _forbidding:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
