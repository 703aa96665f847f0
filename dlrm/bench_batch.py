"""Where the compressed step pays, by batch size (:mod:`comera_rec.dlrm.bench`,
``--batch-sizes``): every variant's training step at several batch sizes, all variants in one
process, their steps interleaved on the same batches, each ratio against dense TorchRec's
step at the same size.

A compressed step has costs that do not shrink with the batch (the optimizer's pass over
every core, the chain merges, the cores' gradients written whole, Python and autograd per
call); dense TorchRec's lookups and optimizer touch only the rows a batch reads. Below some
per-process batch, the compressed step is the slower one: the size at which that happens
matters under ``torchrun``, where each process trains its share of the global batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Sequence

from comera_rec.dlrm.bench_setup import Setup, build, train_batches, train_step, use_lookup_path, variants
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory


def batch_size_times(
    setup: Setup,
    sizes: Sequence[int],
    names: Sequence[str] | None = None,
    steps: int = 40,
    warmup: int = 15,
) -> dict[int, dict[str, float]]:
    """Median step seconds of each variant at each batch size: ``{size: {variant: s}}``.

    Each variant's model is built once (the same seed as the benchmark's) and trains on
    every size in turn; at each size the variants run the same batches, in an order that
    reverses every step so that none always follows the same one.

    Args:
        setup: the benchmark's shapes (rank, interaction, malloc setting); its batch size is
            not used.
        sizes: the batch sizes, each at least 1.
        names: the variants (the benchmark's own: dense, dense_fi, tt, tt_half by default).
        steps: timed steps per size, each on a batch of its own.
        warmup: untimed steps per size and variant first.
    """
    check_sizes(sizes)
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    names = list(variants(setup) if names is None else names)
    if setup.keep_freed_memory:
        keep_freed_memory()
    models = {}
    for name in names:
        use_lookup_path(name)
        models[name] = build(name, setup, mlperf=False)
    freeze_live_objects()
    times: dict[int, dict[str, float]] = {}
    for size in sizes:
        data = train_batches(replace(setup, batch_size=size), False, max(warmup, steps))
        for name in names:
            use_lookup_path(name)
            for batch in data[:warmup]:
                train_step(*models[name], batch)
        per_step: dict[str, list[float]] = {name: [] for name in names}
        for i in range(steps):
            for name in names if i % 2 == 0 else names[::-1]:
                use_lookup_path(name)
                start = time.perf_counter()
                train_step(*models[name], data[i])
                per_step[name].append(time.perf_counter() - start)
        times[size] = {name: statistics.median(t) for name, t in per_step.items()}
    return times


def batch_size_table(times: dict[int, dict[str, float]], baseline: str = "dense") -> list[str]:
    """The lines :func:`batch_sizes` prints: per size, each variant's step (ms) and its speed
    against ``baseline``'s (``baseline / variant``: above 1 the variant is faster)."""
    names = list(next(iter(times.values())))
    if baseline not in names:
        raise ValueError(f"the baseline {baseline!r} is not among the variants {names}")
    lines = [f"{'batch':>6s}  " + "  ".join(f"{name:>18s}" for name in names)]
    for size, row in times.items():
        cells = [f"{row[name] * 1e3:8.2f} ms ({row[baseline] / row[name]:4.2f}x)" for name in names]
        lines.append(f"{size:6d}  " + "  ".join(f"{cell:>18s}" for cell in cells))
    return lines


def faster_from(times: dict[int, dict[str, float]], baseline: str = "dense") -> dict[str, int | None]:
    """Per variant but ``baseline``, the smallest of the sizes from which on (that size and
    every larger one measured) its step is faster than ``baseline``'s; ``None`` where the
    largest size's is not."""
    sizes = sorted(times)
    out: dict[str, int | None] = {}
    for name in next(iter(times.values())):
        if name == baseline:
            continue
        first = None
        for size in reversed(sizes):
            if times[size][name] >= times[size][baseline]:
                break
            first = size
        out[name] = first
    return out


def batch_sizes(setup: Setup, sizes: Sequence[int], steps: int = 40, warmup: int = 15) -> dict[int, dict[str, float]]:
    """Print :func:`batch_size_times` as a table, each variant against dense TorchRec at the
    same size. Returns the times."""
    times = batch_size_times(setup, sizes, steps=steps, warmup=warmup)
    print(
        f"the training step by batch size: all variants in one process, steps interleaved on the same "
        f"batches (median of {steps} per size, after {warmup} untimed); (x): dense TorchRec's step over "
        f"the variant's at that size"
    )
    for line in batch_size_table(times):
        print(line)
    print(
        "faster than dense from batch: "
        + ", ".join(
            f"{name} {size if size is not None else 'none of these'}" for name, size in faster_from(times).items()
        )
    )
    return times


def parse_sizes(text: str) -> list[int]:
    """``"64,128,2048"`` -> ``[64, 128, 2048]``; a clear error for anything else."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"batch sizes must be integers separated by commas, got {text!r}") from None
    check_sizes(sizes)
    return sizes


def check_sizes(sizes: Sequence[int]) -> None:
    """Raise, naming them, unless ``sizes`` holds at least one size and every one is >= 1."""
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"batch sizes must be at least 1, got {list(sizes)}")
