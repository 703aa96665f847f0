"""Pooling looked-up rows into bags, and the layouts of pooled bags.

Pure torch, shared by the PyTorch lookups of :mod:`comera_rec.tensor.contract`, the
fused CPU lookup (:mod:`comera_rec.tensor.kernels.ttm_cpu`) and the TorchRec collection.
Bags follow ``nn.EmbeddingBag``'s ``include_last_offset=True`` layout: ``offsets``
``(B + 1,)`` into the ``N`` ids.
"""

from __future__ import annotations

import torch


def pool_bags(
    rows: torch.Tensor,
    row_of_id: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool looked-up rows into bags (``include_last_offset=True`` layout).

    Each id's row is gathered (``index_select``) and added into its bag (``index_add``,
    see :func:`pool_bags_static`): both backward passes are plain scatters / gathers,
    which on CPU made the compressed DLRM step ~4% faster than ``F.embedding_bag``,
    whose backward sorts the ids (docs/performance-history.md).

    Args:
        rows: ``(U, D)`` distinct rows.
        row_of_id: ``(N,)`` which row each id of the input uses.
        offsets: ``(B + 1,)`` bag boundaries into the N ids (well formed: from 0 to N,
            non-decreasing; the callers build or check them).
        mode: ``"sum"`` or ``"mean"`` (mean divides the weighted sum by the bag length).
        per_sample_weights: optional ``(N,)``.

    Returns:
        ``(B, D)``; empty bags give zeros.

    Example::

        >>> rows = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> pool_bags(rows, torch.tensor([0, 1, 1]), torch.tensor([0, 1, 1, 3]), "sum")
        tensor([[1., 0.],
                [0., 0.],
                [0., 4.]])
    """
    return pool_bags_static(rows.index_select(0, row_of_id), offsets, mode, per_sample_weights)


def pool_bags_static(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pool one row per id into bags by a scatter-add: :func:`pool_bags` with
    ``row_of_id = arange(N)``, without host synchronisation.

    ``offsets`` must be well formed (start at 0, end at N, non-decreasing): nothing is
    checked, as a check would read values on the host.

    Args:
        rows: ``(N, D)``, row ``i`` for id ``i``.
        offsets: ``(B + 1,)`` bag boundaries.
        mode: ``"sum"`` or ``"mean"`` (mean divides the weighted sum by the bag length).
        per_sample_weights: optional ``(N,)``.

    Returns:
        ``(B, D)``; empty bags give zeros.

    Example::

        >>> pool_bags_static(torch.ones(3, 2), torch.tensor([0, 1, 1, 3]), "mean")
        tensor([[1., 1.],
                [0., 0.],
                [1., 1.]])
    """
    n, dim = rows.shape
    lengths = offsets[1:] - offsets[:-1]  # (B,)
    bags = torch.arange(lengths.numel(), device=rows.device)
    # output_size: the length is known from the shape, so no sync to count the ids
    bag_of_id = torch.repeat_interleave(bags, lengths, output_size=n)  # (N,)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.to(rows.dtype).unsqueeze(1)
    out = rows.new_zeros(lengths.numel(), dim).index_add(0, bag_of_id, rows)  # (B, D)
    if mode == "mean":
        out = out / lengths.clamp_min(1).to(out.dtype).unsqueeze(1)
    return out


def streams_side_by_side(out: torch.Tensor, stream_batch: int) -> torch.Tensor:
    """``(F * B, D)`` bags of F streams of B samples -> ``(B, F * D)``, stream ``f`` in columns
    ``f * D ...`` (a copy).

    Example::

        >>> streams_side_by_side(torch.arange(4.0).reshape(4, 1), 2)
        tensor([[0., 2.],
                [1., 3.]])
    """
    bags, dim = out.shape
    if bags % stream_batch:
        raise ValueError(f"streams_side_by_side: {bags} bags are not whole streams of {stream_batch}")
    return out.view(bags // stream_batch, stream_batch, dim).transpose(0, 1).reshape(stream_batch, -1)


def divide_bags(out: torch.Tensor, divisor: torch.Tensor, stream_batch: int = 0) -> torch.Tensor:
    """Divide each bag by its entry of ``divisor`` (``(bags,)``), in either layout of
    :func:`~comera_rec.tensor.contract.ttm_embedding_bag`: ``(bags, D)``, or with
    ``stream_batch > 0`` ``(stream_batch, streams * D)`` where bag ``f * stream_batch + b``
    is row ``b``, columns ``f * D ...``.

    Example::

        >>> divide_bags(torch.ones(2, 4), torch.tensor([1.0, 2.0, 4.0, 8.0]), 2)
        tensor([[1.0000, 1.0000, 0.2500, 0.2500],
                [0.5000, 0.5000, 0.1250, 0.1250]])
    """
    divisor = divisor.to(out.dtype)
    if stream_batch <= 0:
        return out / divisor.unsqueeze(1)
    streams = divisor.numel() // stream_batch
    per_sample = divisor.view(streams, stream_batch).t().unsqueeze(2)  # (stream_batch, streams, 1)
    return (out.view(stream_batch, streams, -1) / per_sample).reshape(stream_batch, -1)
