"""Static input buffers of a captured step: :func:`make_static` builds them from a batch,
:func:`copy_into` refills them each step and names the field whose layout differs
(re-exported by :mod:`comera_rec.training.cuda_graph`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch


class BatchLayoutError(ValueError):
    """A batch does not fit the static buffers of a captured step (the message names the field)."""

    __module__ = "comera_rec.training.cuda_graph"  # its public home (re-exported there): tracebacks and pickles name it


@functools.lru_cache(maxsize=None)
def kjt_type() -> Optional[type]:
    """TorchRec's ``KeyedJaggedTensor`` class, or None when torchrec is not installed."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:  # torchrec is a dependency, but keep the graph code importable without it
        return None
    return KeyedJaggedTensor


PLAIN_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def static_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new contiguous buffer on ``device`` holding a copy of ``t``."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)  # contiguous, owned by the step
    out.copy_(t.detach())
    return out


def is_dataclass_instance(obj: Any) -> bool:
    """True for an instance of a dataclass (not the class itself)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def init_fields(obj: Any) -> list[str]:
    """Names of the dataclass ``obj``'s init fields."""
    return [f.name for f in dataclasses.fields(obj) if f.init]


def make_static(batch: Any, device: torch.device | str) -> Any:
    """A copy of ``batch`` whose tensors are new buffers on ``device``, to capture against.

    Supported: tensors, ``KeyedJaggedTensor`` (values, lengths, offsets and weights
    become buffers; keys, stride, ``length_per_key`` and ``offset_per_key`` are fixed,
    computed now if the KJT has not cached them), dicts, lists, tuples (named ones
    too), dataclasses (their init fields), and plain values (None, bool, int, float,
    str), which are kept and must not change.

    Args:
        batch: the first batch.
        device: where the buffers live (the capture's device).

    Returns:
        The static batch, same structure.

    Raises:
        BatchLayoutError: an unsupported type or a variable-stride KJT (names the field).

    Example::

        >>> static = make_static({"x": torch.ones(2), "n": 3}, "cpu")
        >>> static["x"], static["n"]
        (tensor([1., 1.]), 3)
    """
    return make_static_at(batch, torch.device(device), "batch")


def make_static_at(obj: Any, device: torch.device, path: str) -> Any:
    """:func:`make_static` of ``obj``, found at ``path`` of the batch (named in errors)."""
    if isinstance(obj, torch.Tensor):
        return static_tensor(obj, device)
    kjt = kjt_type()
    if kjt is not None and isinstance(obj, kjt):
        if obj.variable_stride_per_key():
            raise BatchLayoutError(
                f"{path}: KeyedJaggedTensor with variable batch sizes per feature cannot be captured"
            )
        weights = obj.weights_or_none()
        return kjt(
            keys=list(obj.keys()),
            values=static_tensor(obj.values(), device),
            lengths=static_tensor(obj.lengths(), device),
            offsets=static_tensor(obj.offsets(), device),
            weights=static_tensor(weights, device) if weights is not None else None,
            stride=obj.stride(),
            # host metadata, fixed for the graph: readers then never compute it (a sync)
            length_per_key=list(obj.length_per_key()),
            offset_per_key=list(obj.offset_per_key()),
        )
    if isinstance(obj, dict):
        items = {k: make_static_at(v, device, f"{path}[{k!r}]") for k, v in obj.items()}
        return items if type(obj) is dict else type(obj)(items)
    if isinstance(obj, (list, tuple)):
        items = [make_static_at(v, device, f"{path}[{i}]") for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*items)
        return type(obj)(items)
    if is_dataclass_instance(obj):
        return dataclasses.replace(
            obj, **{n: make_static_at(getattr(obj, n), device, f"{path}.{n}") for n in init_fields(obj)}
        )
    if isinstance(obj, PLAIN_TYPES):
        return obj
    raise BatchLayoutError(
        f"{path}: a {type(obj).__name__} cannot be held in static buffers (supported: tensors, "
        f"KeyedJaggedTensor, dict, list, tuple, dataclass, None / bool / int / float / str)"
    )


def copy_tensor(static: torch.Tensor, new: Any, path: str) -> None:
    """Copy tensor ``new`` into buffer ``static``; a BatchLayoutError naming ``path`` if it does not fit."""
    if not isinstance(new, torch.Tensor):
        raise BatchLayoutError(f"{path}: expected a tensor as in the captured batch, got {type(new).__name__}")
    if new.shape != static.shape:
        raise BatchLayoutError(
            f"{path}: shape {list(new.shape)} differs from the captured {list(static.shape)}; a captured "
            f"step replays fixed shapes (use one batch size, drop or pad the last batch, and a fixed "
            f"number of ids per feature: one-hot or padded)"
        )
    if new.dtype != static.dtype:
        raise BatchLayoutError(f"{path}: dtype {new.dtype} differs from the captured {static.dtype}")
    static.copy_(new.detach(), non_blocking=True)


def copy_into(static: Any, batch: Any, path: str = "batch") -> None:
    """Copy ``batch`` into the buffers of ``static`` (made by :func:`make_static`).

    Every tensor must have the captured shape and dtype, a KJT the captured keys,
    stride and ``length_per_key`` (ids per feature), and every plain value must be
    equal: the graph replays what was captured.

    Args:
        static: the static batch.
        batch: the new batch, same structure (any device).
        path: the name of the root in errors.

    Raises:
        BatchLayoutError: naming the first field that differs.

    Example::

        >>> static = make_static({"x": torch.zeros(2)}, "cpu")
        >>> copy_into(static, {"x": torch.ones(2)}); static["x"]
        tensor([1., 1.])
        >>> copy_into(static, {"x": torch.ones(3)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        comera_rec.training.cuda_graph.BatchLayoutError: batch['x']: shape [3] differs from the captured [2]; ...
    """
    if isinstance(static, torch.Tensor):
        copy_tensor(static, batch, path)
        return
    kjt = kjt_type()
    if kjt is not None and isinstance(static, kjt):
        if not isinstance(batch, kjt):
            raise BatchLayoutError(f"{path}: expected a KeyedJaggedTensor, got {type(batch).__name__}")
        if list(batch.keys()) != list(static.keys()):
            raise BatchLayoutError(f"{path}: keys {list(batch.keys())} differ from the captured {list(static.keys())}")
        if batch.variable_stride_per_key() or batch.stride() != static.stride():
            raise BatchLayoutError(
                f"{path}: stride (batch size) {batch.stride()} differs from the captured {static.stride()}"
            )
        lengths = list(batch.length_per_key())  # a sync only if the batch is on a GPU and lacks it
        if lengths != list(static.length_per_key()):
            raise BatchLayoutError(
                f"{path}: ids per feature (length_per_key) {lengths} differ from the captured "
                f"{list(static.length_per_key())}; a captured step needs a fixed number of ids per "
                f"feature (one-hot or padded)"
            )
        copy_tensor(static.values(), batch.values(), f"{path}.values")
        copy_tensor(static.lengths(), batch.lengths(), f"{path}.lengths")
        copy_tensor(static.offsets(), batch.offsets(), f"{path}.offsets")
        weights = batch.weights_or_none()
        if (weights is None) != (static.weights_or_none() is None):
            raise BatchLayoutError(f"{path}.weights: present in one of the batch and the captured batch only")
        if weights is not None:
            copy_tensor(static.weights(), weights, f"{path}.weights")
        return
    if isinstance(static, dict):
        if not isinstance(batch, dict) or list(batch.keys()) != list(static.keys()):
            got = list(batch.keys()) if isinstance(batch, dict) else type(batch).__name__
            raise BatchLayoutError(f"{path}: keys {got} differ from the captured {list(static.keys())}")
        for k, v in static.items():
            copy_into(v, batch[k], f"{path}[{k!r}]")
        return
    if isinstance(static, (list, tuple)):
        if type(batch) is not type(static) or len(batch) != len(static):
            raise BatchLayoutError(
                f"{path}: a {type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'} "
                f"differs from the captured {type(static).__name__} of length {len(static)}"
            )
        for i, (s, b) in enumerate(zip(static, batch)):
            copy_into(s, b, f"{path}[{i}]")
        return
    if is_dataclass_instance(static):
        if type(batch) is not type(static):
            raise BatchLayoutError(
                f"{path}: a {type(batch).__name__} differs from the captured {type(static).__name__}"
            )
        for n in init_fields(static):
            copy_into(getattr(static, n), getattr(batch, n), f"{path}.{n}")
        return
    if type(batch) is not type(static) or batch != static:
        raise BatchLayoutError(
            f"{path}: value {batch!r} differs from the captured {static!r} (plain values are "
            f"baked into the captured step)"
        )


def detach_tree(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples (not named ones) detached."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return type(obj)((k, detach_tree(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(detach_tree(v) for v in obj)
    return obj


@torch.no_grad()
def copy_outputs(dst: Any, src: Any) -> None:
    """Copy the tensors of ``src`` into those of ``dst``, same structure (skipped where they are the same memory)."""
    if isinstance(dst, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            copy_outputs(dst[k], src[k])
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            copy_outputs(a, b)
