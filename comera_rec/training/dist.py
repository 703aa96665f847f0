"""Where this process stands in a run: process group, rank, world size, torchrun restarts.

One definition for the engine, checkpoints, metrics and the run directory, which each
asked "is a process group up" in words of their own.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn


def is_distributed() -> bool:
    """Whether a process group of more than one process is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def process_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def restart_count() -> int:
    """How often torchrun has restarted this run's workers (``TORCHELASTIC_RESTART_COUNT``; 0
    for a first attempt or outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def shard() -> tuple[int, int]:
    """``(rank, world size)`` of this process: which part of the data it reads."""
    return process_rank(), world_size()


def unwrap_data_parallel(module: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (``module`` itself otherwise)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
