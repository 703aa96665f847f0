"""Argument and input checks of the library's layers: every error names the argument and
the offending value."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (int, NumPy integer, integer 0-d tensor), else None."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    if isinstance(value, float):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_rank_argument(name: str, rank: Any) -> int | list[int]:
    """Validate the ``rank`` argument of a layer: an integer, or a sequence of integers.

    Only the type and the sign are checked here; how many ranks a sequence must hold is
    the layer's to check (it depends on the shape).

    Args:
        name: the layer, for errors (``"TTLinear"``).
        rank: what the caller passed.

    Returns:
        ``rank`` as an ``int``, or as a list of ``int``.

    Raises:
        TypeError: ``rank`` is neither an integer nor a sequence of integers (a float, a
            string, a bool, None), or an entry of the sequence is not an integer.
        ValueError: an empty sequence, or a rank below 1.

    Example::

        >>> check_rank_argument("TTLinear", 4)
        4
        >>> check_rank_argument("TTLinear", 4.5)
        Traceback (most recent call last):
        ...
        TypeError: TTLinear: rank must be an int or a sequence of ints, got 4.5 (float)
    """
    single = _as_int(rank)
    if single is not None:
        if single < 1:
            raise ValueError(f"{name}: rank must be an integer >= 1, got {single}")
        return single
    if isinstance(rank, torch.Tensor) and rank.dim() == 1:
        rank = rank.tolist()
    if isinstance(rank, (str, bytes)) or not isinstance(rank, Sequence):
        raise TypeError(f"{name}: rank must be an int or a sequence of ints, got {rank!r} ({type(rank).__name__})")
    if len(rank) == 0:
        raise ValueError(
            f"{name}: rank must be an int or a non-empty sequence of ints, got an empty {type(rank).__name__}"
        )
    ranks: list[int] = []
    for i, r in enumerate(rank):
        value = _as_int(r)
        if value is None:
            raise TypeError(f"{name}: rank[{i}] must be an int, got {r!r} ({type(r).__name__})")
        if value < 1:
            raise ValueError(f"{name}: rank must be an integer >= 1, got {value} (rank[{i}])")
        ranks.append(value)
    return ranks


def bags_look_valid(ids: torch.Tensor, offsets: torch.Tensor, num_embeddings: int) -> bool:
    """Whether ids and offsets pass :func:`check_bags`'s value checks, read from the device
    in one copy (one host synchronisation instead of one per check); :func:`check_bags`
    finds and names what is wrong when this says ``False``.

    Example::

        >>> bags_look_valid(torch.tensor([0, 4, 2]), torch.tensor([0, 2, 3]), 5)
        True
        >>> bags_look_valid(torch.tensor([0, 5, 2]), torch.tensor([0, 2, 3]), 5)
        False
    """
    if offsets.numel() == 0:
        return False
    parts = [offsets[0], offsets[-1]]  # views: no index tensor to copy to the device
    if ids.numel() > 0:
        parts += list(torch.aminmax(ids))
    if offsets.numel() > 1:
        parts.append((offsets[1:] < offsets[:-1]).any())
    read = torch.stack([p.long() for p in parts]).tolist()
    first, last, rest = read[0], read[1], read[2:]
    if first != 0 or last != ids.numel():
        return False
    if ids.numel() > 0:
        lo, hi = rest[0], rest[1]
        rest = rest[2:]
        if lo < 0 or hi >= num_embeddings:
            return False
    return not (rest and rest[0])


def check_bags(
    name: str,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    num_embeddings: int,
    per_sample_weights: torch.Tensor | None = None,
) -> None:
    """Validate an ``include_last_offset=True`` bag batch.

    Args:
        name: what to call the input in errors (a table or feature name).
        ids: ``(N,)`` integer ids in ``[0, num_embeddings)``.
        offsets: ``(B + 1,)`` non-decreasing, starting at 0 and ending at N.
        num_embeddings: rows of the table.
        per_sample_weights: optional floating ``(N,)``.

    Tensors on the ``meta`` device have no values: for them only dtypes and shapes are
    checked.

    Raises:
        TypeError: for non-integer ids/offsets or non-floating weights.
        ValueError: for out-of-range ids, bad offsets or weights of the wrong length.
    """
    for what, t in (("ids", ids), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name}: {what} must be a 1-D integer tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if offsets.numel() == 0:
        raise ValueError(f"{name}: offsets must hold at least one entry (include_last_offset=True layout)")
    if per_sample_weights is not None:
        if not per_sample_weights.dtype.is_floating_point:
            raise TypeError(f"{name}: per_sample_weights must be floating point, got {per_sample_weights.dtype}")
        if per_sample_weights.shape != ids.shape:
            raise ValueError(
                f"{name}: per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                f"expected {tuple(ids.shape)} (one weight per id)"
            )
    if ids.is_meta or offsets.is_meta:
        return  # no values to read
    if ids.device.type != "cpu" and bags_look_valid(ids, offsets, num_embeddings):
        return  # on a GPU every value read is a host sync: one read says all is well
    if ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0:
            raise ValueError(f"{name}: id {lo} is negative")
        if hi >= num_embeddings:
            raise ValueError(f"{name}: id {hi} is out of range for num_embeddings={num_embeddings}")
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise ValueError(f"{name}: offsets must start at 0, got {first}")
    if last != ids.numel():
        raise ValueError(f"{name}: offsets must end at len(ids)={ids.numel()}, got {last}")
    if offsets.numel() > 1:
        steps = offsets[1:] - offsets[:-1]
        if bool((steps < 0).any()):
            at = int((steps < 0).nonzero()[0])
            raise ValueError(
                f"{name}: offsets must be non-decreasing, but offsets[{at + 1}]={int(offsets[at + 1])} "
                f"< offsets[{at}]={int(offsets[at])}"
            )
