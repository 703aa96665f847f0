"""Skeletons of a nested state for the shared part of a checkpoint.

:func:`split_tensors` takes a nested state (dicts, lists, tuples) apart into a flat dict of
tensors keyed by path and a skeleton holding everything else, with a placeholder
(``{PLACEHOLDER: flat key}``) where each tensor was; :func:`fill_skeleton` puts them back
together. Re-exported by :mod:`comera_rec.training.dcp_state`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from comera_rec.training.checkpoint_shards import sharded_tensor_type

PLACEHOLDER = "__dcp__"
"""Key of the dict that stands for a tensor in a skeleton: ``{PLACEHOLDER: flat key}``."""


def is_tensor_like(value: Any) -> bool:
    """True for a tensor or a ShardedTensor (what goes into DCP)."""
    sharded = sharded_tensor_type()
    return isinstance(value, torch.Tensor) or (sharded is not None and isinstance(value, sharded))


def split_tensors(obj: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """Take ``obj`` apart into a skeleton and a flat dict of its tensors.

    Args:
        obj: a nested state of dicts (string or int keys), lists, tuples, tensors,
            ShardedTensors and plain values.
        prefix: the flat keys' first part (``model``); parts are joined with ``/`` so that
            the dots of parameter names stay readable.

    Returns:
        ``(skeleton, flat)``: the skeleton has ``{PLACEHOLDER: key}`` where a tensor was;
        ``flat[key]`` is that tensor.

    Example::

        >>> split_tensors({"w": torch.ones(2), "n": 3}, "m")
        ({'w': {'__dcp__': 'm/w'}, 'n': 3}, {'m/w': tensor([1., 1.])})
    """
    flat: dict[str, Any] = {}

    def walk(x: Any, path: str) -> Any:
        if is_tensor_like(x):
            flat[path] = x
            return {PLACEHOLDER: path}
        if isinstance(x, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v, f"{path}/{i}") for i, v in enumerate(x))
        return x

    return walk(obj, prefix), flat


def fill_skeleton(skeleton: Any, flat: dict[str, Any]) -> Any:
    """Put the tensors of ``flat`` back where :func:`split_tensors` took them from.

    Raises:
        KeyError: a placeholder names a key ``flat`` lacks.
    """
    if isinstance(skeleton, dict):
        if set(skeleton) == {PLACEHOLDER}:
            return flat[skeleton[PLACEHOLDER]]
        return {k: fill_skeleton(v, flat) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(fill_skeleton(v, flat) for v in skeleton)
    return skeleton


def complete_skeleton(skeleton: Any, keys: Iterable[str]) -> Any:
    """``skeleton`` with a placeholder added for every stored key it does not name.

    TorchRec's fused optimiser lists on each process only the tables that process holds,
    so each rank file's skeleton names only its own part of that state; the DCP metadata
    names all of it. Missing entries are added as dict entries along their path (a list
    on the path is indexed by the part's number).

    Args:
        skeleton: a skeleton from a rank file (changed in place and returned).
        keys: every key stored in the DCP folder.

    Raises:
        ValueError: a key's path runs through a value that is not a dict or a list.
    """
    known = set(placeholders(skeleton))
    for key in keys:
        if key in known:
            continue
        parts = key.split("/")
        node = skeleton
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, dict):
                node = node.setdefault(part, {})
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"stored tensor {key!r} does not fit the checkpoint's structure at {parts[i]!r}")
        if not isinstance(node, dict):
            raise ValueError(f"stored tensor {key!r} does not fit the checkpoint's structure")
        node[parts[-1]] = {PLACEHOLDER: key}
    return skeleton


def placeholders(skeleton: Any) -> list[str]:
    """Every flat key named in ``skeleton``, in walk order."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {PLACEHOLDER}:
            return [skeleton[PLACEHOLDER]]
        return [k for v in skeleton.values() for k in placeholders(v)]
    if isinstance(skeleton, (list, tuple)):
        return [k for v in skeleton for k in placeholders(v)]
    return []
