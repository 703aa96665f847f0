"""Input checks for bag lookups: every error names the offending value."""

from __future__ import annotations

import torch


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

    Raises:
        TypeError: for non-integer ids/offsets or non-floating weights.
        ValueError: for out-of-range ids, bad offsets or weights of the wrong length.
    """
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name}: ids must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
    if offsets.dim() != 1 or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise TypeError(f"{name}: offsets must be a 1-D integer tensor, got {offsets.dtype} of shape {tuple(offsets.shape)}")
    if offsets.numel() == 0:
        raise ValueError(f"{name}: offsets must hold at least one entry (include_last_offset=True layout)")
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
    if per_sample_weights is not None:
        if not per_sample_weights.dtype.is_floating_point:
            raise TypeError(f"{name}: per_sample_weights must be floating point, got {per_sample_weights.dtype}")
        if per_sample_weights.shape != ids.shape:
            raise ValueError(
                f"{name}: per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                f"expected {tuple(ids.shape)} (one weight per id)"
            )
