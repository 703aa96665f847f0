"""Fused kernels: Triton for CUDA tensors, C++ for CPU ones, and the switches that decide when they run.

Importing this package never imports Triton: the check runs on the first CUDA lookup
only, so the CPU path pays nothing. The fused Triton lookup is used when

* the ids are CUDA tensors,
* ``triton`` can be imported, and
* it is not disabled: neither ``COMERA_DISABLE_TRITON=1`` in the environment nor
  :func:`set_triton_enabled(False) <set_triton_enabled>`.

See ``docs/gpu.md`` for the design. On CPU, C++ kernels (one extension, built at set-up by
:func:`build_cpu_kernels` / ``python -m comera_rec.tensor.kernels``, else on first use:
:mod:`.cpu_extension`; the lookup: :mod:`.ttm_cpu`) take the TTM lookup and the TT linear
with its ReLU, unless ``COMERA_DISABLE_CPU_KERNEL=1`` or :func:`set_cpu_kernel_enabled(False) <set_cpu_kernel_enabled>`;
each ``*_applies`` function says whether its kernel takes a call. Under ``torch.compile``
the TT layer kernels are called as ``torch.library`` operators (:mod:`.compiled_ops`), so a
compiled graph keeps them. The layers above keep
their own CPU kernels (DLRM's pairwise-dot interaction: ``comera_rec.dlrm.interaction_kernel``;
the row-wise Adagrad tables: ``comera_rec.integration.rowwise_bag_kernel``), small extensions
built the same way (:class:`CpuExtension`) and registered with :func:`register_cpu_extension`,
so that :func:`build_cpu_kernels` builds them too, under the same switch.
"""

from __future__ import annotations

import functools
import importlib
from typing import Sequence

import torch

from comera_rec.tensor.kernels.build_support import KernelBuild, disabled_by_env
from comera_rec.tensor.kernels.cpu_extension import (  # the build of all the CPU kernels, and their switch
    CpuExtension,
    build_cpu_kernels,
    cpu_kernel_enabled,
    cpu_vector_bytes,
    host_description,
    register_cpu_extension,
    set_cpu_kernel_enabled,
)
from comera_rec.tensor.kernels.tt_linear_cpu import (  # the fused CPU TT linear and its chains
    chain_bytes,
    chain_fits,
    l2_cache_bytes,
    tt_chain_cpu,
    tt_chain_kernel_applies,
    tt_chains_cpu,
    tt_chains_kernel_applies,
    tt_cross_cpu,
    tt_linear_cpu,
    tt_linear_cpu_packed,
    tt_linear_kernel_applies,
    tt_linear_pack,
    tt_linear_rank_applies,
)
from comera_rec.tensor.kernels.ttm_cpu import (  # the fused CPU lookup
    autocast_enabled,
    check_jagged,
    cpu_kernel_applies,
    float32_under_cpu_autocast,
    gather_column_blocks,
    ttm_embedding_bag_cpu,
)

DISABLE_ENV = "COMERA_DISABLE_TRITON"

_enabled = True


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
    return not disabled_by_env(DISABLE_ENV) and _enabled and triton_available()


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

    return fused(
        cores, row_shape, embedding_dim, ids, offsets, mode, per_sample_weights, trains, static_shapes=static_shapes
    )


__all__ = [
    "autocast_enabled",
    "build_cpu_kernels",
    "check_jagged",
    "CpuExtension",
    "KernelBuild",
    "DISABLE_ENV",
    "cpu_kernel_applies",
    "cpu_kernel_enabled",
    "cpu_vector_bytes",
    "float32_under_cpu_autocast",
    "gather_column_blocks",
    "host_description",
    "set_cpu_kernel_enabled",
    "ttm_embedding_bag_cpu",
    "chain_bytes",
    "chain_fits",
    "l2_cache_bytes",
    "tt_chain_cpu",
    "tt_chain_kernel_applies",
    "tt_chains_cpu",
    "tt_chains_kernel_applies",
    "tt_cross_cpu",
    "tt_linear_cpu",
    "tt_linear_cpu_packed",
    "tt_linear_kernel_applies",
    "tt_linear_pack",
    "tt_linear_rank_applies",
    "register_cpu_extension",
    "set_triton_enabled",
    "triton_available",
    "triton_enabled",
    "ttm_embedding_bag_triton",
]
