"""The fused CPU pairwise-dot interaction (``interaction_cpu.cpp``) and when it applies.

``[dense, <e_i, e_j> for i < j]`` over ``e = [dense, sparse_1 .. sparse_F]`` per sample,
forward and backward each in one pass over the batch (no ``(B, n, n)`` grid, no
concatenations). A small extension of its own, built as the tensor core's CPU kernels are
(:class:`~comera_rec.tensor.kernels.cpu_extension.CpuExtension`: same flags, cache and vector
width, ``simd.h`` of ``comera_rec/tensor/kernels``), registered at import so that
:func:`~comera_rec.tensor.kernels.build_cpu_kernels` builds it too, and switched on and
off with them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from comera_rec.tensor.kernels.cpu_extension import CpuExtension, cpu_kernels_switched_on, register_cpu_extension
from comera_rec.tensor.kernels.ttm_cpu import cpu_float_operands, records_grad

EXTENSION = register_cpu_extension(
    CpuExtension(
        "comera_dlrm_cpu",
        [Path(__file__).with_name("interaction_cpu.cpp")],
        "DLRM's fused CPU interaction kernel",
        "the interaction uses the PyTorch path",
    )
)


def pairwise_kernel_applies(dense: torch.Tensor, sparse: torch.Tensor) -> bool:
    """Whether the interaction is the fused CPU kernel's to do: real CPU float32 / float64
    tensors of one dtype, outside tracing and ``torch.export`` (under ``torch.compile`` the
    kernel is the operator ``comera_train::pairwise_dots``), kernel enabled."""
    return cpu_float_operands(dense, sparse, compiled=True) and cpu_kernels_switched_on() and _kernel_built()


@torch.compiler.assume_constant_result  # a constant of the process: torch.compile takes its value
def _kernel_built() -> bool:
    return EXTENSION.load() is not None


class _FusedPairwiseDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense, sparse):
        ctx.save_for_backward(dense, sparse)
        return EXTENSION.load().pairwise_dots_forward(dense, sparse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dense, sparse = ctx.saved_tensors
        return tuple(EXTENSION.load().pairwise_dots_backward(grad, dense, sparse))


# the name torch.profiler gives the fused interaction's forward while training (its autograd
# node); the backward's is the name + "Backward" (benchmarks read them)
PROFILER_NAMES = (_FusedPairwiseDots.__name__,)


def pairwise_dots_cpu(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """``(B, D), (B, F, D) -> (B, D + (F + 1) F / 2)``: the dense features, then the dot
    products of every pair ``i < j`` of ``[dense, sparse_1 .. sparse_F]`` in row-major
    order (TorchRec's dot interaction layout). The caller checks
    :func:`pairwise_kernel_applies` first."""
    if torch.compiler.is_compiling():
        return pairwise_dots_op(dense, sparse)
    if not records_grad(dense, sparse):
        return EXTENSION.load().pairwise_dots_forward(dense, sparse)
    return _FusedPairwiseDots.apply(dense, sparse)


# The kernel as operators, for graphs torch.compile makes (the autograd function above is a
# graph break there), as the TT layers' are (comera_rec.tensor.kernels.compiled_ops).
@torch.library.custom_op("comera_train::pairwise_dots", mutates_args=(), device_types="cpu")
def pairwise_dots_op(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """:func:`pairwise_dots_cpu` as an operator ``comera_train::pairwise_dots``."""
    return EXTENSION.load().pairwise_dots_forward(dense, sparse)


@pairwise_dots_op.register_fake
def _pairwise_dots_fake(dense, sparse):
    features = sparse.shape[1]
    return dense.new_empty((dense.shape[0], dense.shape[1] + (features + 1) * features // 2))


@torch.library.custom_op("comera_train::pairwise_dots_backward", mutates_args=(), device_types="cpu")
def pairwise_dots_backward_op(
    grad: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``dense`` and ``sparse`` from the output's."""
    grad_dense, grad_sparse = EXTENSION.load().pairwise_dots_backward(grad.contiguous(), dense, sparse)
    return grad_dense, grad_sparse


@pairwise_dots_backward_op.register_fake
def _pairwise_dots_backward_fake(grad, dense, sparse):
    return dense.new_empty(dense.shape), sparse.new_empty(sparse.shape)


def _pairwise_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pairwise_backward(ctx, grad):
    dense, sparse = ctx.saved_tensors
    return pairwise_dots_backward_op(grad, dense, sparse)


pairwise_dots_op.register_autograd(_pairwise_backward, setup_context=_pairwise_setup)
