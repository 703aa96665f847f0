"""Serving benchmark: compressed vs dense TorchRec DLRM scoring rows, eager and exported.

Four variants at Criteo Kaggle shapes (``--quick``: tiny shapes, a smoke run):

* ``dense_eager``: TorchRec's ``DLRM`` (``EmbeddingBagCollection``, TorchRec's interaction),
  loaded from its saved state dict, called on ``(dense, KeyedJaggedTensor)``: the baseline.
* ``dense_export``: its inference form (:mod:`comera_rec.dlrm.export`) exported, loaded with
  ``torch.export.load`` in an interpreter that imports torch only (no TorchRec, no
  comera-rec), as a server of the program would run it.
* ``tt_eager``: the compressed model (TTM tables, TT layers, fused interaction, rank 32)
  as the trainer builds it, loaded from its saved state dict (fused CPU kernels on).
* ``tt_export``: its exported inference form, run as ``dense_export``.
* ``tt_kernels``: its exported inference form with the fused CPU kernels as operators
  (``export_dlrm(..., kernels=True)``: the lookup, TT layers and the interaction as
  ``torch.ops.comera_rec`` calls), run as ``dense_export`` after
  ``torch.ops.load_library`` of the operator library (:mod:`comera_rec.dlrm.serving_ops`;
  left out, with a line saying so, where it cannot be built).

One process builds both models (seed 0; the figures do not depend on trained values) and
saves, per model, the eager state dict (``torch.save``) and the exported program
(``torch.export.save``), and the input batches (Zipf ids, as in ``comera_rec.dlrm.bench``; a
few distinct batches per size, cycled). Then each variant runs alone in a fresh process, as
a server would: it reads the inputs, loads its model file (the load time), scores every
batch size under ``torch.inference_mode`` and reports rows/s, p50 / p99 latency per batch
and its peak RSS (``ru_maxrss``: imports, inputs and model). The same rows per CPU second
and p50 CPU time per batch (``time.process_time``) say how much work a batch is where
other processes share the host (wall times then include waits for a core). Ratios are
against ``dense_eager`` from the same run.

    python launch/bench_serving.py                      # Kaggle shapes, batches 1, 64, 512, 4096
    python launch/bench_serving.py --batches 1 4096 --iters 30   # a shorter run
    python launch/bench_serving.py --quick              # tiny shapes, seconds
"""

# The docstring above is the command's --help, so the layout is said here: the set-up
# (models, inputs, files) is in serving_setup.py, the processes that prepare and measure in
# serving_measure.py; this module runs them and makes the tables.

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from comera_rec.dlrm.serving_measure import (  # noqa: F401  (re-exported: importable from here as before the split)
    in_process,
    load_eager,
    measure_child,
    measure_exported,
    prepare_child,
    time_batches,
)
from comera_rec.dlrm.serving_ops import LIBRARY, operator_library
from comera_rec.dlrm.serving_setup import (  # noqa: F401  (re-exported too)
    EXPORTED_FORMS,
    INPUTS,
    TINY_TABLE_SIZES,
    VARIANTS,
    ServingSetup,
    batches,
    model_config,
    paths,
    variant_file,
)
from comera_rec.utils.benchmark import fmt_bytes
from comera_rec.utils.logs import quiet_foreign_notices

BASELINE = "dense_eager"
FIGURES = ("rows_s", "p50_s", "p99_s", "cpu_rows_s", "cpu_p50_s")  # per batch size


# ------------------------------------------------------------------------------ the run


@dataclass
class ServingReport:
    """What :func:`run` measured and the markdown tables printed."""

    setup: ServingSetup
    prepared: dict[str, dict]
    """Per model kind: params, export seconds, exported-vs-eager max abs difference."""
    results: dict[str, dict]
    """Per variant: ``load_s``, ``peak``, ``base``, ``file_bytes`` and ``batch`` -> {rows_s, p50_s, p99_s}."""
    table: str


def run(setup: ServingSetup) -> ServingReport:
    """Prepare both models, measure every variant in fresh processes, make the tables."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        setup = replace(setup, workdir=setup.workdir or tmp)
        Path(setup.workdir).mkdir(parents=True, exist_ok=True)
        if "tt_kernels" in setup.variants and operator_library() is None:
            print(f"tt_kernels left out: the operator library is not available ({LIBRARY.error})", flush=True)
            setup = replace(setup, variants=tuple(v for v in setup.variants if v != "tt_kernels"))
        kinds = sorted({v.split("_")[0] for v in setup.variants})
        prepared = in_process(prepare_child, ",".join(kinds), setup)  # one process builds both
        runs: dict[str, list[dict]] = {v: [] for v in setup.variants}
        for _ in range(setup.rounds):
            for v in setup.variants:  # alternating: the machine's drift hits every variant alike
                runs[v].append(
                    measure_exported(v, setup)
                    if v.split("_")[1] in EXPORTED_FORMS
                    else in_process(measure_child, v, setup)
                )
        results = {}
        for v, rs in runs.items():
            file = variant_file(setup.workdir, v)
            results[v] = {
                "load_s": statistics.median(r["load_s"] for r in rs),
                "peak": max(r["peak"] for r in rs),
                "base": min(r["base"] for r in rs),
                "file_bytes": file.stat().st_size,
                "batch": {
                    b: {k: statistics.median(r["batch"][b][k] for r in rs) for k in FIGURES} for b in setup.batch_sizes
                },
            }
    return ServingReport(setup, prepared, results, tables(setup, prepared, results))


def tables(setup: ServingSetup, prepared: dict[str, dict], results: dict[str, dict]) -> str:
    """The markdown tables of a run: per variant and batch size, then per variant."""
    base = results.get(BASELINE)
    lines = [
        "| variant | batch | rows/s | vs dense_eager | p50 ms | p99 ms | p99 vs dense_eager "
        "| rows/CPU-s | vs dense_eager | CPU ms p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in setup.batch_sizes:
        for v, r in results.items():
            x = r["batch"][b]
            ref = base["batch"][b] if base else None
            speed = f"{x['rows_s'] / ref['rows_s']:.2f}x" if ref else "-"
            p99 = f"{x['p99_s'] / ref['p99_s']:.2f}x" if ref else "-"
            cpu_speed = f"{x['cpu_rows_s'] / ref['cpu_rows_s']:.2f}x" if ref else "-"
            lines.append(
                f"| {v} | {b} | {x['rows_s']:,.0f} | {speed} | {x['p50_s'] * 1e3:.3f} | {x['p99_s'] * 1e3:.3f} | {p99} "
                f"| {x['cpu_rows_s']:,.0f} | {cpu_speed} | {x['cpu_p50_s'] * 1e3:.3f} |"
            )
    lines += [
        "",
        "| variant | file | smaller | load s | peak RSS | RSS ratio | peak RSS - imports | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in results.items():
        own = r["peak"] - r["base"]
        smaller = f"{base['file_bytes'] / r['file_bytes']:.1f}x" if base else "-"
        ratio = f"{base['peak'] / r['peak']:.2f}x" if base else "-"
        own_ratio = f"{(base['peak'] - base['base']) / max(own, 1):.1f}x" if base else "-"
        lines.append(
            f"| {v} | {fmt_bytes(r['file_bytes'])} | {smaller} | {r['load_s']:.3f} | {fmt_bytes(r['peak'])} | "
            f"{ratio} | {fmt_bytes(own)} | {own_ratio} |"
        )
    notes = "; ".join(
        f"{k}: {p['params']:,} parameters, export {p['export_s']:.1f} s, exported vs eager max |diff| "
        f"{p['max_abs_diff']:.1e}"
        + (f" (with the kernels {p['kernels_max_abs_diff']:.1e})" if "kernels_max_abs_diff" in p else "")
        for k, p in prepared.items()
    )
    lines += ["", notes]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> ServingReport:
    """The command line of ``launch/bench_serving.py`` (``argv``, ``None``: ``sys.argv[1:]``);
    prints the tables and returns the report.

    Example::

        >>> report = main(["--quick"])  # doctest: +SKIP
        >>> report.results["tt_export"]["batch"][64]["rows_s"] > 0  # doctest: +SKIP
        True
    """
    quiet_foreign_notices()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few batches: a smoke run")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 64 512 4096)")
    parser.add_argument("--iters", type=int, default=None, help="timed batches per size and process (default 100)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed batches per size first (default 5)")
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per variant (default 1)")
    parser.add_argument(
        "--mlperf", action="store_true", help="MLPerf DLRM-DCNv2 shapes, compressed variants only (dense: 97 GiB)"
    )
    parser.add_argument(
        "--no-heap-reuse",
        action="store_true",
        help="glibc's malloc defaults in the measuring processes (default: freed blocks up to 256 MiB reused)",
    )
    parser.add_argument("--rank", type=int, default=32, help="TT rank of tables and MLP layers (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (default 1.1)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="variants to run")
    parser.add_argument(
        "--start-method",
        choices=["spawn", "forkserver"],
        default=None,
        help="how the measuring processes start (default spawn)",
    )
    parser.add_argument("--workdir", default=None, help="keep the model files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    for name in ("iters", "rounds", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")
    if args.mlperf and args.quick:
        parser.error("--mlperf and --quick are different shapes: choose one")
    if args.mlperf and any(v.startswith("dense") for v in args.variants):
        if args.variants != list(VARIANTS):
            parser.error("--mlperf: the dense model's tables need 97 GiB; run --variants tt_eager tt_export tt_kernels")
        args.variants = [v for v in VARIANTS if v.startswith("tt")]
    setup = ServingSetup(
        rounds=args.rounds,
        rank=args.rank,
        threads=args.threads,
        zipf=args.zipf,
        mlperf=args.mlperf,
        heap_reuse=not args.no_heap_reuse,
    )
    if args.quick:
        setup = replace(setup, quick=True, batch_sizes=(1, 64, 512), iters=10, warmup=2, distinct=2)
    setup = replace(
        setup,
        batch_sizes=tuple(args.batches) if args.batches else setup.batch_sizes,
        iters=args.iters or setup.iters,
        warmup=args.warmup if args.warmup is not None else setup.warmup,
        variants=tuple(args.variants),
        workdir=args.workdir,
        start_method=args.start_method or setup.start_method,
    )
    shapes = (
        "tiny shapes (--quick)"
        if setup.quick
        else f"{'MLPerf DLRM-DCNv2' if setup.mlperf else 'Criteo Kaggle'} shapes, rank {setup.rank}"
    )
    print(
        f"serving: {shapes}, Zipf({setup.zipf}) ids, {setup.threads} thread(s) per process, "
        f"{setup.iters} timed batches per size after {setup.warmup}, {setup.rounds} process(es) per variant, "
        f"malloc {'reusing freed blocks up to 256 MiB' if setup.heap_reuse else 'defaults (--no-heap-reuse)'}",
        flush=True,
    )
    report = run(setup)
    print(report.table, flush=True)
    return report
