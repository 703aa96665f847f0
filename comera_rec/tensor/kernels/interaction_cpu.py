"""The fused CPU pairwise-dot interaction (``interaction_cpu.cpp``) and when it applies.

``[dense, <e_i, e_j> for i < j]`` over ``e = [dense, sparse_1 .. sparse_F]`` per sample,
forward and backward each in one pass over the batch (no ``(B, n, n)`` grid, no
concatenations). Built with the other CPU kernels, in one extension (see :mod:`.ttm_cpu`),
and switched on and off with them.
"""

from __future__ import annotations

import torch

from comera_rec.tensor.kernels.ttm_cpu import cpu_float_tensors_apply, extension


def pairwise_kernel_applies(dense: torch.Tensor, sparse: torch.Tensor) -> bool:
    """Whether the interaction is the fused CPU kernel's to do: real CPU float32 / float64
    tensors of one dtype, outside tracing and ``torch.compile``, kernel enabled."""
    return cpu_float_tensors_apply(dense, sparse)


class _FusedPairwiseDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, sparse):
        ctx.save_for_backward(dense, sparse)
        return extension().pairwise_dots_forward(dense, sparse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dense, sparse = ctx.saved_tensors
        return tuple(extension().pairwise_dots_backward(grad, dense, sparse))


def pairwise_dots_cpu(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """``(B, D), (B, F, D) -> (B, D + (F + 1) F / 2)``: the dense features, then the dot
    products of every pair ``i < j`` of ``[dense, sparse_1 .. sparse_F]`` in row-major
    order (TorchRec's dot interaction layout). The caller checks
    :func:`pairwise_kernel_applies` first."""
    return _FusedPairwiseDots.apply(dense, sparse)
