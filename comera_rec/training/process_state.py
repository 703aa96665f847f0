"""What belongs to this process rather than to the model: its random number generators'
state (saved into each checkpoint's rank file) and its peak memory."""

from __future__ import annotations

import random
import resource
from typing import Any

import numpy as np
import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA allocations on a GPU, else peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def rng_state(device: torch.device) -> dict[str, Any]:
    """The torch, Python, NumPy (and CUDA on a GPU) RNG states, as tensors and plain values."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py_state[0], torch.tensor(py_state[1], dtype=torch.int64), py_state[2]],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore the RNG states saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(int(x) for x in py[1].tolist()), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], npst[1].numpy().astype(np.uint32), npst[2], npst[3], npst[4]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
