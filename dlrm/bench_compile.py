"""The DLRM's training step with its dense parts compiled (:mod:`comera_rec.dlrm.bench`,
``--compile``): each variant's model with ``dense_arch``, ``inter_arch`` and ``over_arch``
under ``torch.compile`` against the same model eager, in one process, blocks of steps of the
two alternating on the same parameters and batches.

This is how a TorchRec user compiles a DLRM: the dense parts, the sparse arch left eager
(its lookups' de-duplication has data-dependent shapes). The compressed model's compiled
graphs call the fused CPU kernels as operators (``comera_rec.tensor.kernels.compiled_ops``,
``comera_train::pairwise_dots``); dense TorchRec, measured the same way, is the baseline a
compiled compressed model has to beat.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch._dynamo.utils import counters
from torchrec.models.dlrm import DLRM

from comera_rec.dlrm.bench_setup import Setup, build, train_batches, train_step, use_lookup_path
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory

DENSE_PARTS = ("dense_arch", "inter_arch", "over_arch")
BLOCK_STEPS = 10  # steps of one kind before switching to the other


def compiled_against_eager(
    setup: Setup, variant: str, backend: str = "inductor", blocks: int = 12, warmup: int = 20
) -> dict[str, float]:
    """``variant``'s median step eager and with its dense parts compiled, in one process.

    Args:
        setup: the benchmark's shapes (batch size, rank).
        variant: a model of :func:`~comera_rec.dlrm.bench_setup.build` (``dense``, ``tt``, ...).
        backend: ``torch.compile``'s backend (``"aot_eager"`` compiles no C++: for tests).
        blocks: blocks of :data:`BLOCK_STEPS` steps timed, eager and compiled alternating.
        warmup: eager steps before the timed ones (after the compiled model's first steps).

    Returns:
        ``eager_s`` and ``compiled_s`` (median step), ``compile_s`` (the first compiled
        steps: tracing and compiling), ``graphs`` and ``graph_breaks`` (dynamo's counts).
    """
    if setup.keep_freed_memory:
        keep_freed_memory()
    use_lookup_path(variant)
    data = train_batches(setup, False, 2 * BLOCK_STEPS)
    wrapped, optimizer = build(variant, setup, False)
    dlrm = next(m for m in wrapped.modules() if isinstance(m, DLRM))
    eager = {name: getattr(dlrm, name) for name in DENSE_PARTS}
    compiled = {name: torch.compile(part, backend=backend) for name, part in eager.items()}

    def use(parts: dict[str, torch.nn.Module]) -> None:
        for name, part in parts.items():
            setattr(dlrm, name, part)

    torch._dynamo.reset()
    counters.clear()
    use(compiled)
    start = time.perf_counter()
    for step in range(3):  # the training step's graphs, forward and backward, compiled
        train_step(wrapped, optimizer, data[step])
    compile_s = time.perf_counter() - start
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    use(eager)
    for step in range(warmup):
        train_step(wrapped, optimizer, data[step % len(data)])
    freeze_live_objects()  # as the trainer does
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    step = 0
    for block in range(blocks):
        kind = "eager" if block % 2 == 0 else "compiled"
        use(eager if kind == "eager" else compiled)
        for _ in range(BLOCK_STEPS):
            start = time.perf_counter()
            train_step(wrapped, optimizer, data[step % len(data)])
            times[kind].append(time.perf_counter() - start)
            step += 1
    use(eager)
    torch._dynamo.reset()
    return {
        "eager_s": statistics.median(times["eager"]),
        "compiled_s": statistics.median(times["compiled"]),
        "compile_s": compile_s,
        "graphs": graphs,
        "graph_breaks": breaks,
    }


def compile_table(setup: Setup, variants: tuple[str, ...] = ("dense", "tt"), **kwargs: object) -> dict[str, dict]:
    """:func:`compiled_against_eager` for each variant in turn, printed as a table: each
    variant's compiled step against its own eager one, and both against dense TorchRec's
    eager step (when ``dense`` is among the variants)."""
    print(
        f"batch {setup.batch_size}, rank {setup.rank}; dense_arch, inter_arch and over_arch under torch.compile "
        f"against eager, {BLOCK_STEPS}-step blocks alternating in one process per variant",
        flush=True,
    )
    results = {}
    for variant in variants:
        results[variant] = compiled_against_eager(setup, variant, **kwargs)  # type: ignore[arg-type]
    dense = results.get("dense", {}).get("eager_s")
    header = (
        f"{'variant':10s} {'eager ms':>9s} {'compiled ms':>12s} {'compiled/eager':>15s} {'graphs':>7s} {'breaks':>7s}"
    )
    print(header + (f" {'eager vs dense':>15s} {'compiled vs dense':>18s}" if dense else ""))
    for variant, r in results.items():
        line = (
            f"{variant:10s} {r['eager_s'] * 1e3:9.2f} {r['compiled_s'] * 1e3:12.2f} "
            f"{r['eager_s'] / r['compiled_s']:14.3f}x {r['graphs']:7d} {r['graph_breaks']:7d}"
        )
        if dense:
            line += f" {dense / r['eager_s']:14.2f}x {dense / r['compiled_s']:17.2f}x"
        print(line, flush=True)
    print(
        "(compiled/eager above 1: the compiled step is faster; compiling took "
        + ", ".join(f"{v} {r['compile_s']:.0f} s" for v, r in results.items())
        + ")"
    )
    return results
