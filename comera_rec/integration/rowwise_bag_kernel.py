"""Uncompressed embedding tables on CPU with the row-wise Adagrad update fused into backward
(``rowwise_bag_cpu.cpp``).

The tables lie one after the other in a flat float32 buffer (a table-batched embedding's
layout); the forward pools bags into a ``(batch, total_dim)`` matrix, the backward finds
each table's distinct rows (a hash per table, one thread per table), sums their gradients
and applies ``m += mean(g^2); row -= lr / (sqrt(m) + eps) * g`` in place: the update of
FBGEMM's exact row-wise Adagrad, with no gradient tensor in between. A small extension of
its own, built as the tensor core's CPU kernels are
(:class:`~comera_rec.tensor.kernels.cpu_extension.CpuExtension`: same flags, cache and vector
width, ``simd.h`` of ``comera_rec/tensor/kernels``), registered at import so that
:func:`~comera_rec.tensor.kernels.build_cpu_kernels` builds it too, and switched on and
off with them. Imports no TorchRec: :mod:`comera_rec.integration.fused_tables` hands it a
``FusedEmbeddingBagCollection``'s buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from comera_rec.tensor.kernels.cpu_extension import CpuExtension, register_cpu_extension
from comera_rec.tensor.kernels.ttm_cpu import EMPTY

EXTENSION = register_cpu_extension(
    CpuExtension(
        "comera_rowwise_cpu",
        [Path(__file__).with_name("rowwise_bag_cpu.cpp")],
        "the fused CPU row-wise Adagrad kernel",
        "fused collections use FBGEMM",
    )
)


def rowwise_bag_kernel_enabled() -> bool:
    """Whether the kernel takes calls: the CPU kernels not switched off, and it builds."""
    return EXTENSION.enabled()


@dataclass(frozen=True)
class RowwiseTables:
    """Where each feature's table lies in the flat buffers (all ``int64`` CPU tensors).

    Args:
        table_offset: ``(F,)`` first value of feature ``f``'s table in the weight buffer.
        momentum_offset: ``(F,)`` first entry of feature ``f``'s table in the momentum buffer.
        dim_offset: ``(F + 1,)`` feature ``f`` fills output columns
            ``[dim_offset[f], dim_offset[f + 1])``; its rows have that many values.
        rows: ``(F,)`` rows of feature ``f``'s table.
        feature_table: ``(F,)`` the table each feature reads (features sharing one table
            update it together).
    """

    table_offset: torch.Tensor
    momentum_offset: torch.Tensor
    dim_offset: torch.Tensor
    rows: torch.Tensor
    feature_table: torch.Tensor


def rowwise_bag_kernel_applies(weights: torch.Tensor, momentum: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the fused kernel can take these buffers: contiguous CPU float32 weights and
    momentum, CPU ids, outside tracing and ``torch.compile``, kernels enabled."""
    return (
        weights.device.type == "cpu"
        and weights.dtype == torch.float32
        and weights.is_contiguous()
        and momentum.device.type == "cpu"
        and momentum.dtype == torch.float32
        and momentum.is_contiguous()
        and ids.device.type == "cpu"
        and not torch.jit.is_tracing()
        and not torch.compiler.is_compiling()
        and EXTENSION.enabled()
    )


class _RowwiseAdagradBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights, momentum, tables, ids, offsets, per_sample_weights, batch, lr, eps, out_columns):
        width, cols = out_columns if out_columns is not None else (0, [])
        out = EXTENSION.load().rowwise_bag_forward(
            weights.detach(),
            tables.table_offset,
            tables.dim_offset,
            tables.rows,
            ids,
            offsets,
            per_sample_weights,
            batch,
            width,
            cols,
        )
        # the buffers are updated in place in backward, not differentiated: kept as they are
        ctx.buffers = (weights.detach(), momentum)
        ctx.args = (tables, ids, offsets, per_sample_weights, batch, lr, eps, width, cols)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        weights, momentum = ctx.buffers
        tables, ids, offsets, per_sample_weights, batch, lr, eps, width, cols = ctx.args
        EXTENSION.load().rowwise_bag_backward_adagrad(
            grad,
            weights,
            momentum,
            tables.table_offset,
            tables.momentum_offset,
            tables.dim_offset,
            tables.rows,
            tables.feature_table,
            ids,
            offsets,
            per_sample_weights,
            batch,
            float(lr),
            float(eps),
            width,
            cols,
        )
        return (None,) * 10


def rowwise_adagrad_bag(
    weights: torch.Tensor,
    momentum: torch.Tensor,
    tables: RowwiseTables,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch: int,
    lr: float | torch.Tensor,
    eps: float,
    out_columns: tuple[int, Sequence[int]] | None = None,
) -> torch.Tensor:
    """Sum-pooled lookup whose backward applies exact row-wise Adagrad to the tables in place.

    The caller checks :func:`rowwise_bag_kernel_applies` first. An id outside its table
    raises an error naming it, the feature and the range.

    Args:
        weights: the flat float32 weight buffer; if it requires grad (a parameter) the
            output does, and backward updates it in place (its ``.grad`` stays ``None``).
        momentum: the flat float32 row-wise momentum buffer, one entry per table row.
        tables: the per-feature layout (:class:`RowwiseTables`).
        ids: ``(N,)`` int32 / int64 row ids, bags feature-major (bag ``f * batch + b``).
        offsets: ``(F * batch + 1,)`` bag boundaries.
        per_sample_weights: optional ``(N,)`` weights.
        batch: samples per feature.
        lr: learning rate (a tensor is read when backward runs, as a scheduler may set it).
        eps: added to the root of the momentum.
        out_columns: ``(width, cols)``: the bags laid out in a ``(batch, width)`` output,
            feature ``f`` from column ``cols[f]`` (for a caller whose other lookups write
            the other columns in place; those are left unwritten here).

    Returns:
        ``(batch, total_dim)`` pooled bags, feature ``f`` in its ``dim_offset`` columns
        (with ``out_columns``, ``(batch, width)``).

    Example::

        >>> w, m = torch.randn(12).requires_grad_(), torch.zeros(6)
        >>> tables = RowwiseTables(*(torch.tensor(v) for v in ([0], [0], [0, 2], [6], [0])))
        >>> out = rowwise_adagrad_bag(w, m, tables, torch.tensor([1, 4]), torch.tensor([0, 1, 2]), None, 2, 0.1, 1e-8)
        >>> out.shape
        torch.Size([2, 2])
    """
    psw = per_sample_weights if per_sample_weights is not None else EMPTY.to(torch.float32)
    layout = None if out_columns is None else (int(out_columns[0]), [int(c) for c in out_columns[1]])
    return _RowwiseAdagradBag.apply(weights, momentum, tables, ids, offsets, psw, int(batch), lr, float(eps), layout)
