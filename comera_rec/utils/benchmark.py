"""Side-by-side timing and per-process peak memory for benchmarks.

Shared machines are noisy: variants are timed interleaved (A, B, A, B, ...) in one
process and compared by the ratio of their medians; memory is measured in a fresh
process per variant so one variant's allocations never count against another.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Callable


def time_interleaved(variants: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each variant, the variants run in turn.

    Args:
        variants: name -> zero-argument callable doing one unit of work.
        repeats: timed rounds.
        warmup: untimed rounds first.

    Returns:
        name -> median seconds.

    Example::

        >>> t = time_interleaved({"a": lambda: sum(range(100))}, repeats=3, warmup=1)
        >>> t["a"] > 0
        True
    """
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM; per address space, so a spawned
    child does not inherit its parent's peak as ``getrusage`` would)."""
    return _status_kib("VmHWM") * 1024


def current_rss_bytes() -> int:
    """Resident set size now."""
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Reset the peak RSS to the current RSS (Linux ``clear_refs`` value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _child(target: Callable[[], None], queue) -> None:  # pragma: no cover - runs in a child
    import gc

    # The first run warms the libraries (thread pools, kernel workspaces) and is not
    # billed; the second, measured run starts from the RSS after the first was freed.
    target()
    gc.collect()
    reset_peak_rss()
    base = current_rss_bytes()
    target()
    queue.put((base, peak_rss_bytes()))


def peak_rss_of(target: Callable[[], None]) -> tuple[int, int]:
    """Run ``target`` twice in a fresh process; return (RSS before the second run, peak
    RSS during it).

    The child uses a fixed malloc mmap threshold so that freed large buffers go back to
    the system and RSS follows live memory. ``target`` must be picklable (a
    module-level function or a partial of one).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    try:
        proc = ctx.Process(target=_child, args=(target, queue))
        proc.start()
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    result = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"memory probe of {getattr(target, '__name__', target)} exited with {proc.exitcode}")
    return result


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"
