"""Where the DLRM benchmark's step goes (:mod:`comera_rec.dlrm.bench`, ``--parts``): each
part's forward + backward timed, variants interleaved, and its matrix-multiply FLOPs against
this machine's sgemm throughput."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from comera_rec.dlrm.bench_setup import Setup, build, train_batches, train_step, use_lookup_path, variants
from comera_rec.dlrm.interaction_kernel import PROFILER_NAMES as INTERACTION_KERNELS
from comera_rec.tensor import kernels
from comera_rec.tensor.kernels.tt_linear_cpu import PROFILER_NAMES as TT_LAYER_KERNELS
from comera_rec.tensor.kernels.ttm_cpu import PHASE_KINDS as TTM_LOOKUP_PHASES
from comera_rec.tensor.kernels.ttm_cpu import PROFILER_NAMES as TTM_LOOKUP_KERNELS
from comera_rec.tensor.kernels.ttm_cpu import take_contraction_flops
from comera_rec.tensor.linear import NarrowLinear, TTLinear
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory
from comera_rec.utils.logs import quiet_profiler_banners


def _dlrm(wrapped: nn.Module) -> nn.Module:
    """TorchRec's ``DLRM`` inside ``DLRMTrain`` (single process: not wrapped further)."""
    return getattr(wrapped, "module", wrapped).model


def upstream_gradient(kept: dict[tuple[int, ...], torch.Tensor], output: torch.Tensor) -> torch.Tensor:
    """A gradient of ones for a part's ``output``, made once per shape and kept in ``kept``.

    In a training step a part's output gradient is written by the next part's backward
    (or the loss's), so making it here would time a fill of the output's size (3.4 MB at
    the Kaggle lookups' ``(2048, 26, 16)``) that the step does not have."""
    grad = kept.get(tuple(output.shape))
    if grad is None or grad.dtype != output.dtype:
        grad = kept[tuple(output.shape)] = torch.ones_like(output)
    return grad


def part_times(
    wrapped: nn.Module, batch, count_flops: bool = False, kept: dict[tuple[int, ...], torch.Tensor] | None = None
) -> dict[str, float]:
    """Seconds (or, with ``count_flops``, matrix-multiply FLOPs) of forward + backward of
    each part of one step, run one after the other on the batch (the sparse arch includes
    the fused table update in its backward).

    Each part's output gradient comes from ``kept`` (:func:`upstream_gradient`; pass the
    same dict to every call, so that only a first, warm-up call makes them)."""
    dlrm, state, out = _dlrm(wrapped), {}, {}
    kept = {} if kept is None else kept

    def lookups() -> None:
        emb = dlrm.sparse_arch(batch.sparse_features)  # (B, F, D)
        emb.backward(upstream_gradient(kept, emb))
        state["emb"] = emb.detach().requires_grad_()

    def bottom() -> None:
        dense = dlrm.dense_arch(batch.dense_features)  # (B, D)
        dense.backward(upstream_gradient(kept, dense))
        state["dense"] = dense.detach().requires_grad_()

    def interaction() -> None:
        inter = dlrm.inter_arch(dense_features=state["dense"], sparse_features=state["emb"])  # (B, D + F(F+1)/2)
        inter.backward(upstream_gradient(kept, inter))
        state["inter"] = inter.detach().requires_grad_()

    def top() -> None:
        logits = dlrm.over_arch(state["inter"])
        logits.backward(upstream_gradient(kept, logits))

    for name, run in (("lookups", lookups), ("bottom MLP", bottom), ("interaction", interaction), ("top MLP", top)):
        if count_flops:
            with FlopCounterMode(display=False) as counter:
                run()
            out[name] = float(counter.get_total_flops())
        else:
            t = time.perf_counter()
            run()
            out[name] = time.perf_counter() - t
    wrapped.zero_grad(set_to_none=True)
    return out


SGEMM_SIZE = 2048  # the n of the n^3 float32 GEMM whose throughput is the FLOP yardstick


class SgemmProbe:
    """The FLOP yardstick timed beside the measured work: one ``n^3`` float32 GEMM per
    :meth:`time_once`, so that a host whose speed drifts over a run (these shared hosts
    move by 1.5x within minutes) gives the parts and their yardstick from the same minutes.

    Example::

        >>> probe = SgemmProbe(n=64)
        >>> probe.time_once(); probe.time_once()
        >>> probe.flops_per_second() > 0 and len(probe.seconds) == 2
        True
    """

    def __init__(self, n: int = SGEMM_SIZE) -> None:
        self.n = n
        self._a, self._b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(self._a, self._b)  # untimed: the first call sets up BLAS's threads and buffers
        self.seconds: list[float] = []

    def time_once(self) -> None:
        start = time.perf_counter()
        torch.mm(self._a, self._b)
        self.seconds.append(time.perf_counter() - start)

    def flops_per_second(self) -> float:
        """``2 n^3`` over the median of the timed GEMMs."""
        return sgemm_rate(self.seconds, self.n)

    def spread(self) -> tuple[float, float]:
        """The slowest and the fastest GEMM's rate (FLOP/s) among the timed ones."""
        if not self.seconds:
            raise ValueError("no GEMM timed: the spread needs at least one")
        return sgemm_rate([max(self.seconds)], self.n), sgemm_rate([min(self.seconds)], self.n)


def sgemm_rate(seconds: list[float], n: int) -> float:
    """FLOP/s of an ``n^3`` GEMM that took the median of ``seconds``.

    Example::

        >>> sgemm_rate([2.0, 1.0, 4.0], n=10) == 2 * 10**3 / 2.0
        True
    """
    if not seconds:
        raise ValueError("no GEMM timed: the rate needs at least one")
    return 2 * n**3 / statistics.median(seconds)


def parts(setup: Setup, repeats: int = 20) -> None:
    """Where the step goes: each part's forward + backward, variants interleaved; then each
    part's matrix-multiply FLOPs against the time a 2048^3 sgemm's throughput allows, that
    sgemm timed once in each of the same rounds (:class:`SgemmProbe`)."""
    if setup.keep_freed_memory:
        keep_freed_memory()
    names_ = variants(setup)
    models = {v: build(v, setup, mlperf=False) for v in names_}
    data = train_batches(setup, False, repeats + 2)
    freeze_live_objects()
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in names_}
    kept: dict[tuple[int, ...], torch.Tensor] = {}  # the parts' output gradients, made in the warm-up
    probe = SgemmProbe()
    for i in range(repeats + 2):
        if i >= 2:
            probe.time_once()  # the yardstick in the same rounds as the parts
        for v in names_:
            use_lookup_path(v)
            times = part_times(models[v][0], data[i % len(data)], kept=kept)
            t = time.perf_counter()
            train_step(*models[v], data[i % len(data)])
            times["whole step"] = time.perf_counter() - t
            if i >= 2:  # warm-up
                for k, sec in times.items():
                    samples[v].setdefault(k, []).append(sec)
    names = list(samples["dense"])
    median = {v: {n: statistics.median_high(samples[v][n]) for n in names} for v in names_}
    print(
        f"forward + backward per part, median of {repeats} interleaved rounds (ms), batch {setup.batch_size}; "
        "each part's output gradient made once, before the timed rounds"
    )
    print(f"{'variant':14s}" + "".join(f"{n:>13s}" for n in names))
    for v in names_:
        print(f"{v:14s}" + "".join(f"{median[v][n] * 1e3:13.1f}" for n in names))

    rate = probe.flops_per_second()
    slowest, fastest = probe.spread()
    # counted on the PyTorch path: the counter sees ATen ops only, not inside the C++ kernels,
    # and the kernels do the same products; per part, and the fused TT layers' own
    kernels.set_cpu_kernel_enabled(False)
    flops = {v: part_times(models[v][0], data[0], count_flops=True) for v in names_}
    layer_flops = {v: fused_layer_flops(models[v][0], data[0]) for v in names_}
    interaction_flops = {v: interaction_pass_flops(models[v][0], data[0]) for v in names_}
    kernels.set_cpu_kernel_enabled(True)
    print(
        f"\nmatrix-multiply FLOPs per part (forward + backward, torch.utils.flop_counter, counted on the "
        f"PyTorch path; lookups: the TTM contractions only, FBGEMM's row reads count 0) against a {probe.n}^3 "
        f"sgemm at {rate / 1e9:.0f} GFLOP/s (the median of one sgemm per timed round, "
        f"{slowest / 1e9:.0f}-{fastest / 1e9:.0f} GFLOP/s over the rounds):"
        f"\nGFLOP / time those FLOPs need at that rate (ms) / measured time over it"
    )
    print(f"{'variant':14s}" + "".join(f"{n:>22s}" for n in names[:-1]))
    for v in names_:
        cells = []
        for n in names[:-1]:
            ideal = flops[v][n] / rate
            over = f"{median[v][n] / ideal:6.1f}x" if ideal > 0 else "      -"
            cells.append(f"{flops[v][n] / 1e9:7.3f} / {ideal * 1e3:5.2f} / {over}")
        print(f"{v:14s}" + "".join(f"{c:>22s}" for c in cells))

    # The lookups part holds memory-bound work with no FLOPs counted (row tables, id checks,
    # column-block gathers), the MLP parts more than their fused layers (the chain merges,
    # small dense layers, autograd): the kernels that do those parts' products, against their
    # own FLOPs, from one profile of each variant's step
    measured, layer_times, interaction_times = {}, {}, {}
    for v in names_:
        use_lookup_path(v)
        times, contraction_flops = kernel_times(lambda m=models[v], b=itertools.cycle(data): train_step(*m, next(b)))
        if flops[v]["lookups"] > 0:
            measured[v] = lookup_phases(times, contraction_flops)
        layer_times[v] = fused_kernel_times(times)
        interaction_times[v] = fused_kernel_times(times, INTERACTION_KERNELS)
    lookup_flops = {v: flops[v]["lookups"] for v in measured}
    print("\n" + "\n".join(lookup_kernel_report(measured, lookup_flops, rate)))
    print("\n" + "\n".join(fused_kernel_report(layer_times, layer_flops, rate)))
    report = fused_kernel_report(
        interaction_times, interaction_flops, rate, INTERACTION_HEADING, "no fused interaction kernel"
    )
    print("\n" + "\n".join(report))


FUSED_LAYER_KINDS = (TTLinear, NarrowLinear)  # the layers the fused CPU TT kernels run while training


def module_flops(root: nn.Module, phases: Sequence[Callable[[], object]], kinds: tuple[type, ...]) -> list[float]:
    """Matrix-multiply FLOPs that each of ``phases`` spends inside the submodules of ``root``
    of a type in ``kinds``, by ``torch.utils.flop_counter``: the phases run in order under one
    counter (a forward, then the backward of its result, is one pass). The first phase must
    call ``root`` itself: the counter names each module by its path from the first module
    called. Modules of ``kinds`` must not nest, and must be called with their tensors as
    positional arguments: the counter sees a module's backward end through its positional
    inputs only, and counts one called with keyword tensors (DLRM's interaction) as running
    until the whole backward's end (:func:`interaction_pass_flops` counts that one).

    Example::

        >>> net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> module_flops(net, [lambda: net(torch.randn(3, 8))], (nn.Linear,)) == [2 * 3 * (8 * 4 + 4 * 2)]
        True
    """
    root_name = type(root).__name__
    names = [f"{root_name}.{path}" if path else root_name for path, m in root.named_modules() if isinstance(m, kinds)]

    def total(counts: dict[str, dict]) -> float:
        return float(sum(sum(counts.get(name, {}).values()) for name in names))

    totals = []
    with FlopCounterMode(display=False) as counter:
        for phase in phases:
            phase()
            totals.append(total(counter.get_flop_counts()))  # a copy: the count so far
    return [after - before for before, after in zip([0.0, *totals], totals)]


def fused_layer_flops(wrapped: nn.Module, batch) -> tuple[float, float]:
    """``(forward, backward)`` matrix-multiply FLOPs of one training step's layers that the
    fused CPU TT kernels run (``FUSED_LAYER_KINDS``), counted on whatever path is on (the
    PyTorch path, where the counter sees every product; the TT layers' chain merges, a few
    percent, included), in one forward and backward."""
    losses = []
    forward, backward = module_flops(
        wrapped,
        (lambda: losses.append(wrapped(batch)[0]), lambda: losses.pop().backward()),
        FUSED_LAYER_KINDS,
    )
    wrapped.zero_grad(set_to_none=True)
    return forward, backward


def interaction_pass_flops(wrapped: nn.Module, batch) -> tuple[float, float]:
    """``(forward, backward)`` matrix-multiply FLOPs of one call of the DLRM's interaction on
    the batch's pooled embeddings and bottom MLP output (made first, uncounted), counted on
    whatever path is on; the interaction called with its tensors positionally, so that its
    backward's count ends where its own backward does (:func:`module_flops`)."""
    dlrm = _dlrm(wrapped)
    with torch.no_grad():
        sparse = dlrm.sparse_arch(batch.sparse_features).requires_grad_()  # (B, F, D)
        dense = dlrm.dense_arch(batch.dense_features).requires_grad_()  # (B, D)
    outputs = []
    forward, backward = module_flops(
        dlrm.inter_arch,
        (lambda: outputs.append(dlrm.inter_arch(dense, sparse)), lambda: outputs.pop().sum().backward()),
        (type(dlrm.inter_arch),),
    )
    return forward, backward


def fused_kernel_times(times: dict[str, float], names: Sequence[str] = TT_LAYER_KERNELS) -> tuple[float, float]:
    """``(forward, backward)`` seconds per step in fused CPU kernels (their autograd nodes'
    own time; ``names`` the forward nodes', each backward's the name + ``"Backward"``; by
    default the TT layers' single layers and chains) in a profile (:func:`op_self_times`);
    ``(0.0, 0.0)`` where the step ran none."""
    forward = sum(times.get(name, 0.0) for name in names)
    backward = sum(times.get(f"{name}Backward", 0.0) for name in names)
    return forward, backward


TT_LAYERS_HEADING = (
    "the TT layers' fused CPU kernels' own time (torch.profiler, in the step) against their layers' FLOP time "
    "(counted on the PyTorch path, the chain merges included):"
)
INTERACTION_HEADING = (
    "the fused interaction kernel's own time (torch.profiler, in the step) against the interaction's FLOP time "
    "(counted on the PyTorch path: the whole (n, n) grid forward, one batched product backward):"
)


def fused_kernel_report(
    seconds: dict[str, tuple[float, float]],
    flops: dict[str, tuple[float, float]],
    rate: float,
    heading: str = TT_LAYERS_HEADING,
    absent: str = "no fused TT layer",
) -> list[str]:
    """The lines ``--parts`` prints about fused CPU kernels (by default the TT layers'), per
    variant: their forward and backward time (``seconds``, :func:`fused_kernel_times`)
    against their modules' FLOPs (``flops``, :func:`fused_layer_flops` or
    :func:`interaction_pass_flops`) at ``rate`` FLOP/s,
    under ``heading``. A variant whose step runs none of them is named with ``absent``.

    Example::

        >>> fused_kernel_report({"tt": (0.002, 0.006)}, {"tt": (2e8, 4e8)}, rate=1e11)[1]
        'tt             forward  2.00 ms /  2.00 ms = 1.00x   backward  6.00 ms /  4.00 ms = 1.50x'
    """
    lines = [heading]
    for v, (forward, backward) in seconds.items():
        if forward + backward == 0 or v not in flops:
            lines.append(f"{v:14s} {absent}")
            continue
        cells = []
        for what, t, n in (("forward", forward, flops[v][0]), ("backward", backward, flops[v][1])):
            ideal = n / rate
            over = f"{t / ideal:4.2f}x" if ideal > 0 else "(no FLOPs counted)"
            cells.append(f"{what} {t * 1e3:5.2f} ms / {ideal * 1e3:5.2f} ms = {over}")
        lines.append(f"{v:14s} " + "   ".join(cells))
    return lines


def lookup_kernel_report(
    measured: dict[str, tuple[dict[str, float], float]], lookup_flops: dict[str, float], rate: float
) -> list[str]:
    """The lines ``--parts`` prints about the fused TTM lookup kernel, per variant: its time
    (``measured[variant]``: :func:`lookup_phases`' ``(seconds by phase, contraction
    FLOPs)``) against the lookups' FLOPs on the PyTorch path (``lookup_flops``) at ``rate``
    FLOP/s, and by kind of work; its contraction phases against the kernel's own FLOPs; each
    phase. A variant with no phases did not use the kernel."""
    lines = [
        "the TTM lookup kernel's own time (torch.profiler, forward + backward, in the step) against the lookups' "
        "FLOP time, and the kernel's time by kind of work (ms): contraction (products of core slices: FLOPs "
        "that shrink with the rank), per id (per id and distinct row: random row reads), pass (over cores "
        "or slots), calls (argument conversion, output allocation):"
    ]
    for v, (phases, _) in measured.items():
        seconds, ideal = sum(phases.values()), lookup_flops[v] / rate
        if seconds == 0:
            lines.append(f"{v:14s} the fused CPU lookup not used")
            continue
        kinds = "  ".join(f"{k} {t * 1e3:.2f}" for k, t in sorted(phases_by_kind(phases).items()))
        lines.append(f"{v:14s} {seconds * 1e3:6.2f} ms / {ideal * 1e3:5.2f} ms = {seconds / ideal:4.2f}x   ({kinds})")
    # the lookups' FLOP count above is the PyTorch path's, which makes products the kernel
    # does not (a row per id): the contraction phases against the kernel's own FLOPs
    shown = [v for v, (phases, _) in measured.items() if phases]
    if not shown:
        return lines
    lines.append("")
    lines.append(
        "the kernel's contraction phases against their own FLOPs (the kernel's count, at the sgemm rate above):"
    )
    for v in shown:
        phases, contraction_flops = measured[v]
        if contraction_flops > 0:
            seconds, ideal = phases_by_kind(phases).get("contraction", 0.0), contraction_flops / rate
            lines.append(
                f"{v:14s} {seconds * 1e3:6.2f} ms for {contraction_flops / 1e9:.3f} GFLOP "
                f"({ideal * 1e3:5.2f} ms) = {seconds / ideal:4.2f}x"
            )
    lines.append("")
    lines.append("the kernel's phases (ms per step):")
    lines.append(f"{'phase':40s}" + "".join(f"{v:>12s}" for v in shown))
    for name in [*TTM_LOOKUP_PHASES, "calls"]:
        if any(name in measured[v][0] for v in shown):
            row = "".join(f"{measured[v][0].get(name, 0.0) * 1e3:12.3f}" for v in shown)
            lines.append(f"{name:40s}{row}")
    return lines


OP_WARMUP_STEPS = 3  # op_self_times' calls of `step` before the profiled ones


def op_self_times(step, threads: int, steps: int) -> dict[str, float]:
    """Seconds per step spent in each operator itself (its own time, not its callees'), over
    ``steps`` calls of ``step`` with ``threads`` intra-op threads, by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    for _ in range(OP_WARMUP_STEPS):  # the thread pool at its new size
        step()
    with quiet_profiler_banners(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: e.self_cpu_time_total / 1e6 / steps for e in prof.key_averages()}


def kernel_times(step, steps: int = 10) -> tuple[dict[str, float], float]:
    """``(seconds, contraction FLOPs)`` per call of ``step``: each operator's own time
    (:func:`op_self_times` at the current thread count) and the fused TTM lookup's
    contraction FLOPs (:func:`take_contraction_flops`) over the same calls."""
    take_contraction_flops()  # restart the count
    times = op_self_times(step, torch.get_num_threads(), steps)
    return times, take_contraction_flops() / (OP_WARMUP_STEPS + steps)


def lookup_phases(times: dict[str, float], flops: float) -> tuple[dict[str, float], float]:
    """``(seconds, contraction FLOPs)`` of the fused CPU TTM lookup from a profile
    (:func:`kernel_times`' ``times`` and ``flops``): the seconds in each of its phases
    (``TTM_LOOKUP_PHASES``, the kernel's profiler scopes) and under ``"calls"`` the rest of
    its forward and backward (``TTM_LOOKUP_KERNELS``' own time: argument conversion, output
    allocation), and the FLOPs of its contraction phases. ``({}, 0.0)`` where the step did
    not use the kernel."""
    phases = {name: times[name] for name in TTM_LOOKUP_PHASES if name in times}
    calls = sum(times.get(name, 0.0) for name in TTM_LOOKUP_KERNELS)
    return ({**phases, "calls": calls}, flops) if calls > 0 else ({}, 0.0)


def phases_by_kind(phases: dict[str, float]) -> dict[str, float]:
    """:func:`lookup_phases`' seconds summed by kind of work (``TTM_LOOKUP_PHASES``:
    ``"contraction"``, ``"per id"``, ``"pass"``; ``"calls"`` as it is)."""
    kinds: dict[str, float] = {}
    for name, seconds in phases.items():
        kind = TTM_LOOKUP_PHASES.get(name, name)
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return kinds


def thread_scaling(one: dict[str, float], more: dict[str, float], top: int) -> list[tuple[str, float, float, float]]:
    """The ``top`` operators by time on more threads: ``(name, seconds on one, seconds on
    more, one / more)``; an operator seen on one side only counts 0 on the other."""
    rows = []
    for name in sorted(more, key=lambda n: -more[n])[:top]:
        a, b = one.get(name, 0.0), more[name]
        rows.append((name, a, b, a / b if b > 0 else 0.0))
    return rows


def ops(setup: Setup, variant: str = "tt", steps: int = 15, top: int = 25) -> None:
    """Which operators of a variant's step gain from the second thread: each operator's own
    time per step on one thread and on all of them, the thread counts alternating twice in
    one process (the second round is printed)."""
    if setup.keep_freed_memory:
        keep_freed_memory()
    use_lookup_path(variant)
    wrapped, optimizer = build(variant, setup, mlperf=False)
    data = train_batches(setup, False, 8)
    freeze_live_objects()
    counter = itertools.count()

    def step() -> None:
        train_step(wrapped, optimizer, data[next(counter) % len(data)])

    threads = torch.get_num_threads()
    for _ in range(10):  # warm-up
        step()
    times: dict[int, dict[str, float]] = {}
    for _ in range(2):
        for n in sorted({1, threads}):
            times[n] = op_self_times(step, n, steps)
    torch.set_num_threads(threads)
    total = {n: sum(t.values()) for n, t in times.items()}
    print(
        f"{variant}: each operator's own time per step (ms; torch.profiler, {steps} steps, batch {setup.batch_size}), "
        f"1 thread and {threads}; all operators: {total[1] * 1e3:.1f} / {total[threads] * 1e3:.1f} ms "
        f"({total[1] / total[threads]:.2f}x)"
    )
    print(f"{'operator':60s} {'1 thread':>9s} {f'{threads} threads':>10s} {'gain':>6s}")
    for name, a, b, gain in thread_scaling(times[1], times[threads], top):
        print(f"{name[:60]:60s} {a * 1e3:9.3f} {b * 1e3:10.3f} {gain:5.2f}x")
