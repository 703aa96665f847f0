"""Running one computation at several intra-op thread counts (the CPU kernels' determinism tests)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def at_thread_counts(fn: Callable[[], Sequence[torch.Tensor]], counts: Sequence[int]) -> list[list[torch.Tensor]]:
    """``fn()``'s tensors with torch's intra-op pool at each of ``counts`` threads, in order;
    the pool is set back afterwards."""
    before = torch.get_num_threads()
    results = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            results.append(list(fn()))
    finally:
        torch.set_num_threads(before)
    return results


def assert_bit_identical(results: list[list[torch.Tensor]]) -> None:
    """Every run's tensors equal the first run's, bit for bit."""
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
