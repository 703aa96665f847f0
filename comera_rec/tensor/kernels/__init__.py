"""Optional fused lookup kernels, and the switches that decide when they run.

* GPU: Triton kernels for CUDA tensors, used when ``triton`` imports and neither
  ``COMERA_DISABLE_TRITON=1`` nor :func:`set_triton_enabled(False) <set_triton_enabled>`
  turned them off (``docs/gpu.md``).
* CPU: a Numba kernel (``ttm_cpu``) for CPU tensors, used when ``numba`` imports and
  neither ``COMERA_DISABLE_CPU_KERNEL=1`` nor :func:`set_cpu_kernel_enabled(False)
  <set_cpu_kernel_enabled>` turned it off (``docs/performance.md``). Without it the
  PyTorch path of ``contract.ttm_embedding_bag`` runs; both give the same values.

Importing this package imports neither Triton nor Numba: each is checked on the first
lookup that could use it.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Sequence

import torch

DISABLE_ENV = "COMERA_DISABLE_TRITON"
DISABLE_CPU_ENV = "COMERA_DISABLE_CPU_KERNEL"

_enabled = True
_cpu_enabled = True


def _env_disables(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether ``triton`` imports (checked once, then cached)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # ImportError, or a broken install failing at import time
        return False
    return True


def set_triton_enabled(enabled: bool) -> None:
    """Turn the Triton path on or off for this process (the environment switch still wins)."""
    global _enabled
    _enabled = bool(enabled)


def triton_enabled() -> bool:
    """Whether CUDA lookups take the Triton path: importable and not disabled.

    ``COMERA_DISABLE_TRITON`` set to anything but ``""`` / ``"0"`` / ``"false"`` disables it;
    it is read on every call, so it may be changed at run time.
    """
    return not _env_disables(DISABLE_ENV) and _enabled and triton_available()


@functools.lru_cache(maxsize=None)
def numba_available() -> bool:
    """Whether ``numba`` imports (checked once, then cached)."""
    try:
        importlib.import_module("numba")
    except Exception:  # ImportError, or numba refusing this numpy at import time
        return False
    return True


def set_cpu_kernel_enabled(enabled: bool) -> None:
    """Turn the fused CPU lookup on or off for this process (the environment switch still wins)."""
    global _cpu_enabled
    _cpu_enabled = bool(enabled)


def cpu_kernel_enabled() -> bool:
    """Whether CPU lookups take the fused Numba kernel: importable and not disabled
    (``COMERA_DISABLE_CPU_KERNEL``, read on every call, as ``COMERA_DISABLE_TRITON``)."""
    return not _env_disables(DISABLE_CPU_ENV) and _cpu_enabled and numba_available()


def ttm_embedding_bag_triton(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
    *,
    static_shapes: bool = False,
) -> torch.Tensor:
    """The fused Triton lookup with the signature of ``contract.ttm_embedding_bag``.

    Imports the kernel module on first use; see
    :func:`comera_rec.tensor.kernels.ttm_triton.ttm_embedding_bag_triton`.
    """
    from comera_rec.tensor.kernels.ttm_triton import ttm_embedding_bag_triton as fused

    return fused(cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains,
                 static_shapes=static_shapes)


def ttm_embedding_bag_cpu(
    cores: Sequence[torch.Tensor],
    row_shape: Sequence[int],
    embedding_dim: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str = "sum",
    per_sample_weights: torch.Tensor | None = None,
    trains: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused CPU lookup with the signature of ``contract.ttm_embedding_bag``.

    Imports the kernel module (and Numba) on first use; see
    :func:`comera_rec.tensor.kernels.ttm_cpu.ttm_embedding_bag_cpu`.
    """
    from comera_rec.tensor.kernels.ttm_cpu import ttm_embedding_bag_cpu as fused

    return fused(cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains)


__all__ = [
    "DISABLE_CPU_ENV",
    "DISABLE_ENV",
    "cpu_kernel_enabled",
    "numba_available",
    "set_cpu_kernel_enabled",
    "ttm_embedding_bag_cpu",
    "set_triton_enabled",
    "triton_available",
    "triton_enabled",
    "ttm_embedding_bag_triton",
]
