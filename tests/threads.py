"""Running one computation at several intra-op thread counts (the CPU kernels' determinism tests)."""

from __future__ import annotations

import sys
import threading
import time
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


def stamps_during_call(make_call: Callable[[int], Callable[[], object]], min_seconds: float = 0.05) -> int:
    """How often another Python thread ran while a kernel call ran on this one.

    ``make_call(rows)`` returns the call at a problem size: the bound kernel itself with its
    arguments (``functools.partial``), so that no Python line runs between the call's start
    and the kernel's, where the interpreter may hand the lock over. ``rows`` doubles from
    1024 until a call (the faster of two, after a first, warm-up call at 1024) takes
    ``min_seconds`` on one intra-op thread. That call then runs again, its result kept until the clock is read (freeing a
    large tensor lets other threads in), while a second Python thread stamps the time in a
    loop. Returns the stamps from 5 ms after the call began to 5 ms before it ended: none
    while the call holds Python's global lock (the stamping thread cannot run a line until
    it returns; with the switch interval at 1 ms here, it runs at most about that long just
    before and just after the call), many when the call releases it and a core is free.
    """
    margin = 0.005
    before_threads, before_switch = torch.get_num_threads(), sys.getswitchinterval()
    stamps: list[float] = []
    stop = threading.Event()

    def stamp() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    worker = threading.Thread(target=stamp, daemon=True)
    torch.set_num_threads(1)
    try:
        rows = 1024
        call = make_call(rows)
        call()  # warm-up: the first call may build or load the extension
        while True:
            # the faster of two calls: a size's first call also faults its fresh output's
            # pages in, and can take 40x the repeat that is measured below
            took = []
            for _ in range(2):
                start = time.perf_counter()
                call()
                took.append(time.perf_counter() - start)
            if min(took) >= min_seconds or rows >= 1 << 20:
                break
            rows *= 2
            call = make_call(rows)
        sys.setswitchinterval(0.001)
        worker.start()
        time.sleep(0.01)  # the stamping thread is running
        start = time.perf_counter()
        result = call()  # kept: freeing a large result may let the other thread in
        end = time.perf_counter()
        del result
    finally:
        stop.set()
        if worker.is_alive():
            worker.join()
        torch.set_num_threads(before_threads)
        sys.setswitchinterval(before_switch)
    assert end - start > 3 * margin, f"the call took {end - start:.4f} s: too short to tell"
    return sum(start + margin < s < end - margin for s in stamps)
