"""The fused CPU TTM lookup (``ttm_cpu.cpp``): build on first use, and its autograd wrapper.

Each half is contracted whole by one GEMM per train (as the PyTorch path does); then one
C++ pass contracts every id's prefix block with its suffix block and adds the row into
its bag, with no ``unique``, gather or scatter tensors in between. Its backward writes
both halves' gradients in one pass, threads owning disjoint keys (no atomics).

The extension is compiled by ``torch.utils.cpp_extension`` the first time a CPU lookup
runs (~25 s here, then cached under ``TORCH_EXTENSIONS_DIR``). Without a C++ compiler, or
with ``COMERA_DISABLE_CPU_KERNEL=1``, lookups take the PyTorch path.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "COMERA_DISABLE_CPU_KERNEL"
_SOURCE = Path(__file__).with_name("ttm_cpu.cpp")
_enabled = True


@functools.lru_cache(maxsize=None)
def _extension():
    """The compiled module, or ``None`` when it cannot be built (logged once)."""
    try:
        from torch.utils.cpp_extension import load

        logger.info("building the fused CPU TTM lookup (once; cached by torch.utils.cpp_extension)")
        return load(name="comera_ttm_cpu", sources=[str(_SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch path still works
        logger.warning("fused CPU TTM lookup unavailable (%s); using the PyTorch path", exc)
        return None


def set_cpu_kernel_enabled(enabled: bool) -> None:
    """Turn the fused CPU lookup on or off for this process (the environment switch still wins)."""
    global _enabled
    _enabled = bool(enabled)


def cpu_kernel_enabled() -> bool:
    """Whether CPU lookups take the fused kernel: not disabled, and it builds."""
    flag = os.environ.get(DISABLE_ENV, "").strip().lower()
    if flag not in ("", "0", "false", "no", "off"):
        return False
    return _enabled and _extension() is not None


def left_half_view(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole left half as a ``(T, n1, n2, m1, m2, r)`` view of its GEMM's output
    (``n2 = m2 = 1`` for one core): no transposed copy."""
    T, _, n1, m1, r1 = cores[0].shape
    if len(cores) == 1:
        return cores[0].reshape(T, n1, 1, m1, 1, r1)
    _, _, n2, m2, r2 = cores[1].shape
    raw = torch.bmm(cores[0].reshape(T, n1 * m1, r1), cores[1].reshape(T, r1, n2 * m2 * r2))
    return raw.view(T, n1, m1, n2, m2, r2).permute(0, 1, 3, 2, 4, 5)


def right_half_view(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole right half as a ``(T, na, nb, mb, r, ma)`` view (``nb = mb = 1`` for one
    core), from one GEMM per train written as ``(T, nb, mb, na, r, ma)``."""
    a = cores[0]
    T, r, na, ma, ra = a.shape
    if len(cores) == 1:
        return a.view(T, r, na, ma).permute(0, 2, 1, 3).unsqueeze(2).unsqueeze(3)
    b = cores[1]
    _, _, nb, mb, _ = b.shape
    a_t = a.permute(0, 4, 2, 1, 3).reshape(T, ra, na * r * ma)  # (T, r_a, n_a r m_a)
    b_t = b.reshape(T, ra, nb * mb).transpose(1, 2)  # (T, n_b m_b, r_a), a view
    raw = torch.bmm(b_t, a_t)  # (T, nb mb, na r ma)
    return raw.view(T, nb, mb, na, r, ma).permute(0, 3, 1, 2, 4, 5)


class _FusedBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, left, right, prefix_keys, suffix_keys, offsets, dim):
        ctx.save_for_backward(left, right, prefix_keys, suffix_keys, offsets)
        return _extension().ttm_bag_forward(left, right, prefix_keys, suffix_keys, offsets, dim)

    @staticmethod
    def backward(ctx, grad):
        left, right, prefix_keys, suffix_keys, offsets = ctx.saved_tensors
        grad_left, grad_right = _extension().ttm_bag_backward(grad, left, right, prefix_keys, suffix_keys, offsets)
        return grad_left, grad_right, None, None, None, None


def ttm_embedding_bag_cpu(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    trains: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused CPU lookup: :func:`comera_rec.tensor.contract.ttm_embedding_bag` without
    per-sample weights (the caller checks :func:`cpu_kernel_enabled` first).

    Returns:
        ``(B, embedding_dim)`` pooled embeddings.
    """
    from comera_rec.tensor.contract import half_keys  # contract imports this package

    h = (len(cores) + 1) // 2
    prefix_keys, suffix_keys = half_keys(row_shape, ids, trains)  # (N,), (N,)
    left, right = left_half_view(cores[:h]), right_half_view(cores[h:])
    out = _FusedBag.apply(left, right, prefix_keys, suffix_keys, offsets.long(), embedding_dim)  # (B, D)
    if mode == "mean":
        lengths = (offsets[1:] - offsets[:-1]).clamp_min(1)
        out = out / lengths.to(out.dtype).unsqueeze(1)
    return out
