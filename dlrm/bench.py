"""DLRM benchmark: compressed vs dense TorchRec DLRM at Criteo Kaggle shapes, side by side.

Baseline: TorchRec's DLRM with FBGEMM's fused table-batched embedding (row-wise Adagrad
fused into backward) and dense MLPs. Compressed: TTM tables for the large tables and TT
MLP layers, at the starting rank and again with every rank cut to about half. All
variants train on the same synthetic Kaggle-shaped batches (Zipf ids). Step time, peak
RSS and page faults are measured with each variant alone in fresh processes, as it
would train, the variants alternating over several rounds; validation AUC after the same
number of steps, all variants trained in one process (whose interleaved step times are
printed too: sharing a process changes them, see docs/performance.md).

The installed console script ``comera-bench``; from a checkout ``python launch/bench_dlrm.py``
(the same :func:`main`).

    comera-bench                  # Kaggle shapes, batch 2048
    comera-bench --mlperf         # MLPerf DLRM-DCNv2 shapes, compressed only
    comera-bench --quick          # a smoke run
    comera-bench --parts          # where the step goes, per part
    comera-bench --ops tt         # each operator's own time on one thread and on all (what gains
                                  # from the second thread)
    comera-bench --fixed-costs tt # the step against copies without the chain merges, the
                                  # controllers' folds or the optimizer step: what each is worth
    comera-bench --no-fused-interaction  # TorchRec's InteractionArch and SparseArch in the
                                         # compressed models, and no dense_fi (by default the
                                         # compressed models have PairwiseDotInteraction and
                                         # FlatSparseArch, and dense_fi, the dense model with
                                         # them, credits what they, the fused row-wise
                                         # Adagrad lookup and the fused narrow first layer
                                         # give a dense model)
    comera-bench --batch-sizes 64,256,1024,2048  # every variant's step at each batch size, in one
                                  # process: below which per-process batch compression stops paying
    comera-bench --rounds 5       # more fresh processes per variant for the step time
    comera-bench --lookup-paths   # adds tt_torch / tt_half_torch: the same models with the
                                  # fused CPU kernels off (TTM lookup, TT linear, interaction)
    comera-bench --unchained      # adds tt_unchained: tt with its MLPs' TT layers one kernel
                                  # call each (not chained), the chains' share of the step
    comera-bench --isa avx2       # every library's CPU code limited to AVX2 (an AVX2 host's
                                  # code on an AVX-512 host; not its caches or clocks)
    comera-bench --autocast       # every variant's forward under torch.autocast("cpu", bfloat16),
                                  # the simplest speed-up a dense model has on a CPU with bfloat16
                                  # products (the fused kernels stay float32)
    comera-bench --compile        # dense and tt with dense_arch, inter_arch and over_arch under
                                  # torch.compile (inductor) against the same model eager, in one
                                  # process each (the compiled graphs call the fused kernels)
    comera-bench --against REV    # this checkout's step and peak RSS against git revision
                                  # REV's on this host, fresh processes of the two codes
                                  # alternating (did a change slow the step or grow its memory,
                                  # whatever the host's speed today)
"""

# The docstring above is the command's --help, so the layout is said here: the variants,
# their models and batches are in bench_setup.py, the fresh processes in bench_process.py,
# --parts and --ops in bench_parts.py, --fixed-costs in bench_fixed.py, --batch-sizes in
# bench_batch.py, --against in bench_against.py, --compile in bench_compile.py; this module runs them
# and prints the tables.

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import NoReturn

import torch

from comera_rec.dlrm.bench_against import against, checkout_root, resolve_revision, setup_fields
from comera_rec.dlrm.bench_batch import batch_sizes, parse_sizes
from comera_rec.dlrm.bench_compile import compile_table
from comera_rec.dlrm.bench_fixed import fixed_costs
from comera_rec.dlrm.bench_parts import ops, part_times, parts  # noqa: F401  (re-exported)
from comera_rec.dlrm.bench_process import (  # noqa: F401  (re-exported: importable from here as before the split)
    exit_now,
    own_process_rounds,
    paired_speedups,
    process_child,
    run_in_process,
    spread_warning,
)
from comera_rec.dlrm.bench_setup import (  # noqa: F401  (re-exported too)
    DENSE_FUSED,
    EMBEDDING_LR,
    LEARNING_RATES,
    TORCH_LOOKUP,
    VARIANTS,
    Setup,
    adamw,
    auc,
    batches,
    build,
    cut_ranks_to_half,
    forward_precision,
    model_bytes,
    model_config,
    train_batches,
    train_step,
    use_lookup_path,
    variants,
)
from comera_rec.rank import model_num_parameters
from comera_rec.tensor import kernels
from comera_rec.utils.benchmark import fmt_bytes
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory
from comera_rec.utils.isa import (
    ISA_CHOICES,
    check_host_runs,
    cpu_bfloat16_products,
    environment_applies,
    host_cpu_flags,
    isa_environment,
    libraries_isa,
)
from comera_rec.utils.logs import quiet_foreign_notices

# ------------------------------------------------------------------------------ main


def kaggle(setup: Setup) -> None:
    print(
        f"Criteo Kaggle shapes, batch {setup.batch_size}, Zipf({setup.zipf}) ids, rank {setup.rank}; "
        f"{torch.get_num_threads()} threads; malloc keeps freed memory: {setup.keep_freed_memory} "
        f"(every variant alike)"
    )
    if setup.autocast:
        bf16 = sorted({"avx512_bf16", "amx_bf16"} & host_cpu_flags())
        print(
            'forward under torch.autocast("cpu", torch.bfloat16), every variant alike: the dense layers\' products '
            f"in bfloat16 ({', '.join(bf16) or 'no bfloat16 instructions'} on this CPU), the fused CPU kernels in "
            "float32"
        )
    names = variants(setup)
    # Step time, peak RSS and page faults: each variant alone in fresh processes, as it would train.
    alone = own_process_rounds(names, setup, mlperf=False)

    # AUC after equal steps: all variants in this process on the same batches (their
    # interleaved step times are printed too, for comparison with the figures above).
    if setup.keep_freed_memory:
        keep_freed_memory()
    models = {v: build(v, setup, mlperf=False) for v in names}
    freeze_live_objects()
    params = {
        v: model_num_parameters(m[0]) if not v.startswith("dense") else sum(p.numel() for p in m[0].parameters())
        for v, m in models.items()
    }
    sizes = {v: model_bytes(m[0]) for v, m in models.items()}
    times: dict[str, list[float]] = {v: [] for v in names}
    stream = iter(batches(Setup(**{**setup.__dict__}), False, "train", setup.batch_size * setup.train_steps))
    for step in range(setup.train_steps):
        batch = next(stream)
        for v in names:  # interleaved: every variant sees the machine in the same state
            use_lookup_path(v)
            t0 = time.perf_counter()
            train_step(*models[v], batch, setup.autocast)
            times[v].append(time.perf_counter() - t0)
    shared = {v: statistics.median_high(t[3:]) for v, t in times.items()}
    aucs = {}
    for v in names:
        use_lookup_path(v)
        aucs[v] = auc(models[v][0], setup, False)
    del models

    step = {v: alone[v]["step_s"] for v in names}
    fused = DENSE_FUSED in names  # then also the speed-up over the dense model with the same interaction
    print(
        f"\n{'variant':14s} {'step ms':>9s} {'speed-up':>9s}"
        + (f" {'vs ' + DENSE_FUSED:>12s}" if fused else "")
        + f" {'samples/s':>10s} {'params':>13s} "
        f"{'model bytes':>12s} {'smaller':>8s} {'peak RSS':>10s} {'RSS ratio':>9s} {'faults/step':>11s} "
        f"{'val AUC':>8s}"
    )
    for v in names:
        peak = alone[v]["peak"]
        versus = f" {step[DENSE_FUSED] / step[v]:11.2f}x" if fused else ""
        print(
            f"{v:14s} {step[v] * 1e3:9.2f} {step['dense'] / step[v]:8.2f}x{versus} "
            f"{setup.batch_size / step[v]:10.0f} {params[v]:13,d} {fmt_bytes(sizes[v]):>12s} "
            f"{sizes['dense'] / sizes[v]:7.0f}x {fmt_bytes(peak):>10s} {alone['dense']['peak'] / peak:8.1f}x "
            f"{alone[v]['faults']:11.0f} {aucs[v]:8.4f}"
        )
    per_process = {v: alone[v]["steps"] for v in names}
    print(
        f"\nstep: median over {setup.rounds} fresh processes per variant (variants alternating, reversed every other round) of each "
        f"process's median of {setup.timed_steps} steps after {setup.warmup_steps} warm-up steps (AdamW on "
        f"MLPs/cores, fused row-wise Adagrad on dense tables); per-process medians (ms): "
        + "; ".join(f"{v} " + " ".join(f"{t * 1e3:.1f}" for t in times) for v, times in per_process.items())
    )
    warning = spread_warning(per_process)
    if warning:
        print(warning)
    paired = paired_speedups(per_process)
    print(
        "speed-up over dense within each round (its two processes, minutes apart), median: "
        + "; ".join(
            f"{v} " + " ".join(f"{r:.2f}" for r in paired[v]) + f" ({statistics.median(paired[v]):.2f}x)"
            for v in names
            if v != "dense"
        )
    )
    print(
        f"peak RSS: the largest of those processes (imports included: {fmt_bytes(alone['dense']['base'])} "
        f"before the model); AUC on {setup.val_rows} synthetic validation rows after {setup.train_steps} steps"
    )
    # what the imports weigh differs from host to host: the part above them, the model's own
    grown = {v: max(1, alone[v]["peak"] - alone[v]["base"]) for v in names}
    print(
        "peak RSS above the process's RSS before its model: "
        + ", ".join(f"{v} {fmt_bytes(grown[v])} ({grown['dense'] / grown[v]:.1f}x less)" for v in names)
    )
    print(
        "all variants in one process, steps interleaved (median of "
        f"{setup.train_steps - 3}): "
        + ", ".join(f"{v} {shared[v] * 1e3:.1f} ms ({shared['dense'] / shared[v]:.2f}x)" for v in names)
    )


def mlperf(setup: Setup) -> None:
    print(f"MLPerf DLRM-DCNv2 shapes (204M rows, dim 128), compressed at rank {setup.rank}, batch {setup.batch_size}")
    result = run_in_process("tt", setup, mlperf=True)
    print(
        f"  step {result['step_s'] * 1e3:.1f} ms, {setup.batch_size / result['step_s']:.0f} samples/s, "
        f"peak RSS {fmt_bytes(result['peak'])} (before the model: {fmt_bytes(result['base'])})"
    )
    dense_bytes = sum(model_config("dense", setup, True).table_sizes) * 128 * 4
    print(f"  dense tables alone would need {fmt_bytes(dense_bytes)}")


def run_under(environment: dict[str, str], argv: list[str]) -> NoReturn:
    """This command again with ``argv``, in this process replaced by a fresh interpreter
    whose environment adds ``environment`` (the libraries' instruction-set switches, read
    once per process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    code = "from comera_rec.dlrm.bench import main; main()"
    os.execve(sys.executable, [sys.executable, "-c", code, *argv], {**os.environ, **environment})


def main(argv: list[str] | None = None) -> None:
    """The benchmark's command line (``argv``, ``None``: ``sys.argv[1:]``); leaves the process at the end."""
    quiet_foreign_notices()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlperf", action="store_true", help="MLPerf DLRM-DCNv2 shapes, compressed only")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="time each part of the step (lookups, MLPs, interaction) against its FLOP time, and the lookup, TT layer and interaction kernels alone",
    )
    parser.add_argument(
        "--ops",
        metavar="VARIANT",
        choices=(VARIANTS[0], DENSE_FUSED, *VARIANTS[1:]),
        help="each operator's own time in VARIANT's step on one thread and on all (torch.profiler): what gains "
        "from the second thread",
    )
    parser.add_argument(
        "--fixed-costs",
        metavar="VARIANT",
        choices=VARIANTS[1:],
        help="VARIANT's step against copies of its model without the TT layers' chain merges, the TTM tables' "
        "controller folds or the optimizer step, in one process: a bound on what each is worth",
    )
    parser.add_argument(
        "--batch-sizes",
        metavar="SIZES",
        help="comma-separated batch sizes: every variant's step at each, all in one process, steps "
        "interleaved, against dense TorchRec's at the same size",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="dense and tt with their dense parts (dense_arch, inter_arch, over_arch) under torch.compile "
        "(inductor) against the same model eager, blocks of steps alternating in one process per variant",
    )
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke run")
    parser.add_argument("--steps", type=int, default=None, help="training steps per variant")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument(
        "--fused-interaction",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="PairwiseDotInteraction and FlatSparseArch in the compressed models, and dense_fi, the "
        "dense model with them (and so with the fused row-wise Adagrad lookup); default on",
    )
    parser.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="leave glibc malloc as it is (it may return freed activations to the kernel and "
        "page-fault them in again); the default keeps them, as the trainer does",
    )
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per variant for the step time")
    parser.add_argument(
        "--isa",
        choices=ISA_CHOICES,
        default="native",
        help="the instruction set of every library's CPU code: native (the host's widest) or avx2 (ATen, MKL, "
        "FBGEMM and the fused kernels limited to AVX2: an AVX2 host's code on this machine; the fused kernels "
        "are built for it the first time, 1-3 min)",
    )
    parser.add_argument(
        "--lookup-paths",
        action="store_true",
        help="also time the compressed models with the fused CPU kernels off (tt_torch, tt_half_torch)",
    )
    parser.add_argument(
        "--unchained",
        action="store_true",
        help="also time tt with its MLPs' TT layers one kernel call each, not chained (tt_unchained)",
    )
    parser.add_argument(
        "--autocast",
        action="store_true",
        help='every variant\'s forward (training and validation) under torch.autocast("cpu", torch.bfloat16): '
        "the dense layers' products in bfloat16, the fused CPU kernels in float32",
    )
    parser.add_argument(
        "--against",
        metavar="REV",
        help="this checkout's training step and peak RSS against git revision REV's (a worktree of it, its own "
        "benchmark model and kernels), fresh processes of the two codes alternating, --rounds of each",
    )
    parser.add_argument(
        "--against-variants",
        metavar="NAMES",
        default="tt,dense",
        help="comma-separated variants for --against (both codes must have them); default tt,dense",
    )
    args = parser.parse_args(argv)

    def given(*flags: str) -> list[str]:
        """Those of these options the command line set."""
        return [f for f in flags if getattr(args, f.removeprefix("--").replace("-", "_")) not in (None, False)]

    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        sizes = parse_sizes(args.batch_sizes) if args.batch_sizes is not None else None
    except ValueError as exc:
        parser.error(f"--batch-sizes: {exc}")
    if sizes is not None and args.mlperf:
        parser.error("--batch-sizes runs the Kaggle shapes against dense TorchRec; --mlperf has no dense model")
    try:
        check_host_runs(args.isa)
    except ValueError as exc:
        parser.error(f"--isa {args.isa}: {exc}")
    if args.compile:
        other_modes = given("--mlperf", "--parts", "--ops", "--fixed-costs", "--batch-sizes", "--against", "--autocast")
        if other_modes:
            parser.error(
                f"--compile times the Kaggle training step eager and compiled; not with {', '.join(other_modes)}"
            )
    if args.against is not None:
        other_modes = given(
            "--mlperf", "--parts", "--ops", "--fixed-costs", "--batch-sizes", "--lookup-paths", "--unchained", "--steps"
        )
        if other_modes:
            parser.error(f"--against times the training step of --against-variants; not with {', '.join(other_modes)}")
        try:
            resolve_revision(checkout_root(), args.against)
        except (RuntimeError, ValueError) as exc:
            parser.error(f"--against: {exc}")
        against_names = [n.strip() for n in args.against_variants.split(",") if n.strip()]
        if not against_names:
            parser.error("--against-variants: no variant named")
    if args.autocast:
        other_modes = given("--mlperf", "--parts", "--ops", "--fixed-costs", "--batch-sizes", "--against")
        if other_modes:
            parser.error(f"--autocast times the Kaggle variants' training step; not with {', '.join(other_modes)}")
        if args.isa != "native":
            # oneDNN limited too (ONEDNN_MAX_CPU_ISA=AVX2) has no bfloat16 kernels: its products
            # fall to a reference loop, as on a real AVX2 host, where the trainer refuses autocast
            parser.error(
                "--autocast with --isa avx2: torch's bfloat16 products are oneDNN's, which --isa does not limit, "
                "and an AVX2 host has none (its bfloat16 products run in a reference loop; the trainer refuses "
                "trainer.autocast=bfloat16 there)"
            )
        if not cpu_bfloat16_products():
            parser.error(
                f"--autocast: torch has no bfloat16 matrix kernels for this CPU ({libraries_isa()}): its bfloat16 "
                "products run in a reference loop, about 170x slower than in float32 (the trainer refuses "
                "trainer.autocast=bfloat16 here too)"
            )
    wanted = isa_environment(args.isa)
    if not environment_applies(wanted):  # the libraries read their switches once: a fresh process
        run_under(wanted, sys.argv[1:] if argv is None else argv)
    setup = Setup(
        batch_size=args.batch_size,
        rank=args.rank,
        keep_freed_memory=args.keep_freed_memory,
        fused_interaction=args.fused_interaction,
        rounds=args.rounds,
        lookup_paths=args.lookup_paths,
        unchained=args.unchained,
        autocast=args.autocast,
    )
    # where the figures come from
    print(f"host: {kernels.host_description()}; torch {torch.__version__}; {libraries_isa()}", flush=True)
    if args.quick:
        setup = replace(setup, train_steps=10, val_rows=8192, warmup_steps=1, timed_steps=3, rounds=1)
    if args.steps:
        setup = replace(setup, train_steps=args.steps)
    if args.against is not None:
        against(args.against, against_names, setup.rounds, setup_fields(setup, Setup(), args.quick))
    elif args.compile:
        compile_table(setup, **({"blocks": 2, "warmup": 1} if args.quick else {}))
    elif args.ops:
        ops(setup, args.ops, steps=3 if args.quick else 15)
    elif args.fixed_costs:
        fixed_costs(setup, args.fixed_costs, **({"steps": 3, "warmup": 1} if args.quick else {}))
    elif sizes is not None:
        batch_sizes(setup, sizes, **({"steps": 3, "warmup": 1} if args.quick else {}))
    elif args.parts:
        parts(setup)
    else:
        mlperf(setup) if args.mlperf else kaggle(setup)
    exit_now()


if __name__ == "__main__":
    main()
