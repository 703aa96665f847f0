"""The fused CPU TT linear (``tt_linear_cpu.cpp``): its autograd function and when it applies.

``y = act((x @ left) @ right + bias)`` with ``left (N_in, r)`` and ``right (r, N_out)``
the merged chains of a TT weight, forward and backward each in one pass over the batch
in tiles of rows, the bias and the ReLU (and its mask) applied on the way: the BLAS path
(:class:`comera_rec.tensor.contract.TTLinearFunction`) makes six skinny GEMMs and passes
of their own for the bias, the ReLU and its backward, each over a ``(B, N)`` activation.
Built with the fused lookup, in one extension (see :mod:`.ttm_cpu`), and switched on
and off with it.
"""

from __future__ import annotations

import torch

from comera_rec.tensor.kernels.ttm_cpu import _extension, cpu_float_tensors_apply, cpu_vector_bytes

_MAX_RANK_BYTES = 256  # the kernel keeps a row's rank vectors in registers: r <= 64 float32
_MAX_RANK_VECTORS = 8  # ... in at most 8 vectors (the widths the kernel is built for)
_EMPTY = torch.empty(0)


def max_fused_rank(dtype: torch.dtype) -> int:
    """The largest rank the fused CPU TT linear takes for ``dtype``: 64 for float32 and 32
    for float64 with 32- or 64-byte vectors (AVX2, AVX-512); 0 without the kernels."""
    width = cpu_vector_bytes()
    if width == 0:
        return 0
    return min(_MAX_RANK_BYTES, _MAX_RANK_VECTORS * width) // dtype.itemsize


def tt_linear_kernel_applies(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> bool:
    """Whether ``x @ left @ right`` is the fused CPU kernel's to do: real CPU float32 /
    float64 matrices of one dtype, ``r <=`` :func:`max_fused_rank`, outside tracing and
    ``torch.compile``, kernel enabled."""
    return cpu_float_tensors_apply(x, left, right) and 0 < left.shape[1] <= max_fused_rank(x.dtype)


class _FusedTTLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, left, right, bias, relu):
        y, t = _extension().tt_linear_forward(x, left, right, bias if bias is not None else _EMPTY.to(x.dtype), relu)
        ctx.save_for_backward(x, left, right, t, y if relu else _EMPTY.to(x.dtype))
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, left, right, t, y = ctx.saved_tensors
        need_bias = ctx.has_bias and bool(ctx.needs_input_grad[3])
        grad_x, grad_left, grad_right, grad_bias = _extension().tt_linear_backward(
            grad_y, x, left, right, t, y, bool(ctx.needs_input_grad[0]), need_bias, bool(ctx.needs_input_grad[1])
        )
        return grad_x, grad_left, grad_right, grad_bias, None


def tt_linear_cpu(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    bias: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """``act((x @ left) @ right + bias)``, ``act`` the ReLU or none, by the fused kernel.

    The caller checks :func:`tt_linear_kernel_applies` first.

    Args:
        x: ``(B, N_in)``.
        left: ``(N_in, r)``, the merged input chain.
        right: ``(r, N_out)``, the merged output chain.
        bias: optional ``(N_out,)``.
        relu: apply the ReLU to the output (its mask is the output itself).

    Returns:
        ``(B, N_out)``.
    """
    return _FusedTTLinear.apply(x, left, right, bias, bool(relu))
