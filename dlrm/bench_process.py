"""The DLRM benchmark's own processes (:mod:`comera_rec.dlrm.bench`): each variant trained
alone in a fresh process, as it would train, for its step time, peak RSS and page faults."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time

from comera_rec.dlrm.bench_setup import Setup, build, train_batches, train_step, use_lookup_path
from comera_rec.utils.benchmark import current_rss_bytes, peak_rss_bytes
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory, minor_page_faults
from comera_rec.utils.logs import quiet_foreign_notices


def process_child(variant: str, setup: Setup, mlperf: bool, queue) -> None:  # runs in a fresh process
    """Build one variant and train it alone, as a training process would: peak RSS, the
    median step time after a warm-up, and minor page faults per step."""
    quiet_foreign_notices()
    if setup.keep_freed_memory:
        keep_freed_memory()
    use_lookup_path(variant)
    data = train_batches(setup, mlperf, setup.warmup_steps + setup.timed_steps)
    base = current_rss_bytes()
    wrapped, optimizer = build(variant, setup, mlperf)
    freeze_live_objects()  # as the trainer does (trainer.freeze_gc), every variant alike
    times = []
    faults_at_start = minor_page_faults()  # read again when the timed steps begin
    for step in range(setup.warmup_steps + setup.timed_steps):
        if step == setup.warmup_steps:
            faults_at_start = minor_page_faults()
        start = time.perf_counter()
        train_step(wrapped, optimizer, data[step % len(data)], setup.autocast)
        times.append(time.perf_counter() - start)
    faults = (minor_page_faults() - faults_at_start) / setup.timed_steps
    queue.put(
        {
            "base": base,
            "peak": peak_rss_bytes(),
            "step_s": statistics.median_high(times[setup.warmup_steps :]),
            "faults": faults,
        }
    )
    queue.close()
    queue.join_thread()  # the result is in the pipe
    exit_now()


def exit_now() -> None:
    """Leave without the interpreter's teardown. Triton (which torch imports for TorchRec)
    prints a hundred lines of nanobind leak warnings at a normal exit, in every process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_in_process(variant: str, setup: Setup, mlperf: bool) -> dict:
    """:func:`process_child` in a fresh (spawned) process; its result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=process_child, args=(variant, setup, mlperf, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def round_order(names: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The variants' order in round ``round_index``: as given in even rounds, reversed in
    odd ones (A, B, C; C, B, A; ...), so that no variant always runs right after the same
    one. In a fixed order ``tt`` always ran after ``dense_fi``'s 4.6 GB process, and its
    fresh processes were slower than those of the same model after a small one
    (docs/performance-history.md, 2026-12-02).

    Example::

        >>> round_order(("a", "b", "c"), 1)
        ('c', 'b', 'a')
    """
    return names if round_index % 2 == 0 else names[::-1]


def paired_speedups(steps: dict[str, list[float]], baseline: str = "dense") -> dict[str, list[float]]:
    """Per round, ``baseline``'s step over each variant's, from the two fresh processes of that
    round (:func:`own_process_rounds`' per-process ``steps``): a ratio of processes minutes
    apart, which a drift of the machine between rounds moves less than the ratio of medians.

    Example::

        >>> paired_speedups({"dense": [0.06, 0.08], "tt": [0.03, 0.02]})["tt"]
        [2.0, 4.0]
    """
    if baseline not in steps:
        raise ValueError(f"paired speed-ups: no {baseline!r} among {sorted(steps)}")
    base = steps[baseline]
    out = {}
    for v, times in steps.items():
        if len(times) != len(base):
            raise ValueError(f"paired speed-ups: {v} ran {len(times)} rounds, {baseline} {len(base)}")
        out[v] = [b / t for b, t in zip(base, times)]
    return out


# Fresh processes of one variant further apart than this (slowest over fastest) get a warning:
# on the shared 2-core hosts the same work has taken 19.5 or 25.5 ms in neighbouring
# processes (docs/performance-history.md, 2026-12-05), which moves a ratio of medians.
SPREAD_WARNING = 1.15


def spread_warning(steps: dict[str, list[float]], limit: float = SPREAD_WARNING) -> str | None:
    """A line naming the variants whose fresh processes' step times (seconds, one per
    process) are more than ``limit`` times apart, slowest over fastest; ``None`` where none
    are. The same work in every process of a variant, so such a spread is the machine's.

    Example::

        >>> spread_warning({"dense": [0.050, 0.052], "tt": [0.020, 0.025]})
        'the machine moved during the run: tt 20.0-25.0 ms (1.25x apart); the ratio of medians moves with it, the within-round and interleaved ratios less: rerun with more --rounds for a firmer figure'
        >>> spread_warning({"dense": [0.050, 0.052]}) is None
        True
    """
    if limit < 1.0:
        raise ValueError(f"spread_warning: limit must be >= 1, got {limit}")
    wide = []
    for name, times in steps.items():
        if not times or min(times) <= 0:
            raise ValueError(f"spread_warning: {name} needs positive step times, got {times}")
        ratio = max(times) / min(times)
        if ratio > limit:
            wide.append(f"{name} {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms ({ratio:.2f}x apart)")
    if not wide:
        return None
    return (
        "the machine moved during the run: "
        + ", ".join(wide)
        + "; the ratio of medians moves with it, the within-round and interleaved ratios less: "
        "rerun with more --rounds for a firmer figure"
    )


def own_process_rounds(names: tuple[str, ...], setup: Setup, mlperf: bool) -> dict[str, dict]:
    """Each variant in its own fresh process, ``setup.rounds`` times, the variants
    alternating (:func:`round_order`) so that the machine's drift, and what each process
    leaves behind for the next, hit all alike.

    Returns, per variant: the median over rounds of the per-process median step time, of
    the page faults per step, and the largest peak RSS.
    """
    runs: dict[str, list[dict]] = {v: [] for v in names}
    for k in range(setup.rounds):
        for v in round_order(names, k):
            runs[v].append(run_in_process(v, setup, mlperf))
    median = statistics.median_high
    return {
        v: {
            "step_s": median([r["step_s"] for r in rs]),
            "faults": median([r["faults"] for r in rs]),
            "peak": max(r["peak"] for r in rs),
            "base": rs[0]["base"],
            "steps": [r["step_s"] for r in rs],
        }
        for v, rs in runs.items()
    }
