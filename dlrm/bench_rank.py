"""The accuracy-size front: fixed-rank training against the budget rank schedule.

Every run trains the same config for the same number of steps, each in a process of its
own (``python -m comera_rec.dlrm.cli``, what ``comera-train-dlrm`` runs), and reads its ``summary.json``:

- fixed: ``model.rank = model.mlp_rank = r``, the rank schedule off, for each ``--fixed`` r;
- adaptive: from each ``--starts`` rank, the budget schedule with each ``--targets`` ratio
  of the starting model's TT size.

Two sizes are reported. "TT bytes" is what the schedule's target counts: the TT cores at
their live ranks. "Model bytes" is every parameter of the model (TT cores at the live
ranks, tables left dense, MLP biases, ...), the fair axis between ranks: the compression
policy leaves a small table dense where TT would not pay at that rank, so models of
different ranks do not compress the same tables, and TT bytes alone would leave those
dense tables out.

Printed: one row per run (both sizes, validation AUC, live ranks per module, wall time),
then per adaptive setting the mean over seeds against the fixed-rank curve interpolated at
the same size, on each axis (linear in log bytes between the two fixed ranks around it;
outside the fixed range there is no comparison), and how close it came to its target.
Written: ``front.png`` (AUC vs model bytes and vs TT bytes, log x: the fixed curve and one
adaptive curve per start rank) and ``front.json`` in ``--out``. A run whose folder already
holds a ``summary.json`` is read, not run again (``--rerun`` runs everything).

    comera-bench-rank                        # the demo front, 2 seeds (~15 min here)
    comera-bench-rank --preset kaggle        # Kaggle table sizes, synthetic data
    comera-bench-rank --seeds 0 --targets 0.25 --fixed 4 8 16   # a quick look

The installed console script ``comera-bench-rank``; from a checkout
``python launch/bench_rank.py`` (the same :func:`main`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

PRESETS = {
    "demo": ("dlrm_demo", []),  # shipped configs, by name (comera_rec.config.resolve_config)
    # Criteo Kaggle's 26 table sizes and MLPs on the synthetic generator (no download)
    "kaggle": (
        "dlrm_criteo_kaggle",
        [
            "data.source=synthetic",
            "data.synthetic_train_rows=4194304",
            "data.synthetic_val_rows=65536",
            "data.batch_size=1024",
            "trainer.max_steps=3000",
            "trainer.eval_every=1000",
            "trainer.eval_max_batches=32",
            "trainer.checkpoint_at_end=false",
        ],
    ),
}


def summary_row(spec: dict[str, Any], summary: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One row of the front from a run's ``summary.json``.

    Raises:
        ValueError: the summary was written before summaries had ``tt_bytes`` (then
            ``model_bytes`` meant the TT bytes): run it again.
    """
    if "tt_bytes" not in summary:
        raise ValueError(
            f"{run_dir / 'summary.json'} is from an older version (no tt_bytes): "
            "run again with --rerun, or remove that folder"
        )
    return {
        **{k: v for k, v in spec.items() if k != "overrides"},
        "tt_bytes": int(summary["tt_bytes"]),
        "model_bytes": int(summary["model_bytes"]),  # every parameter at the live ranks
        "auc": float(summary["val_auc"]),
        "log_loss": float(summary["val_log_loss"]),
        "wall_s": float(summary["wall_s"]),
        "live_ranks": summary.get("live_ranks", {}),
    }


def run_one(config: str, overrides: list[str], run_dir: Path, threads: int, rerun: bool) -> dict[str, Any]:
    """Train one configuration in a fresh process (unless its summary.json exists and not
    ``rerun``); its summary.json."""
    if not rerun and (run_dir / "summary.json").exists():
        return json.loads((run_dir / "summary.json").read_text())
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [
        sys.executable,
        "-m",
        "comera_rec.dlrm.cli",
        "--config",
        config,
        f"trainer.run_dir={run_dir}",
        "trainer.progress=false",
        "trainer.plots=false",
        *overrides,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {run_dir.name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def interpolate_fixed(fixed: list[tuple[float, float]], size: float) -> Optional[float]:
    """AUC of the fixed-rank curve at ``size`` bytes: linear in log(bytes) between the two
    fixed points around it; None outside the curve's range.

    Example::

        >>> round(interpolate_fixed([(100.0, 0.70), (10000.0, 0.80)], 1000.0), 4)
        0.75
    """
    points = sorted(fixed)
    for (b0, a0), (b1, a1) in zip(points, points[1:]):
        if b0 <= size <= b1:
            if b1 == b0:
                return max(a0, a1)
            w = (math.log(size) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return a0 + w * (a1 - a0)
    return None


def short_ranks(live_ranks: dict[str, list[int]]) -> str:
    """Live ranks per module, with DLRM's module paths shortened.

    Example::

        >>> short_ranks({"model.sparse_arch.embedding_bag_collection.groups.0": [4, 3],
        ...              "model.over_arch.model.0._mlp.1._linear": [2, 5]})
        'tables0:4/3 top1:2/5'
    """
    parts = []
    for name, ranks in live_ranks.items():
        tail = name.replace("._linear", "").split(".")[-1]
        if "embedding" in name:
            key = f"tables{tail}"
        elif "dense_arch" in name:
            key = f"bottom{tail}"
        elif "over_arch" in name:
            key = f"top{tail}"
        else:
            key = name
        parts.append(f"{key}:{'/'.join(str(r) for r in ranks)}")
    return " ".join(parts)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def plot_front(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        label = "fixed rank" if row["kind"] == "fixed" else f"adaptive from rank {row['start']}"
        groups.setdefault(label, []).append(row)
    for ax, key, xlabel in (
        (axes[0], "model_bytes", "model bytes, every parameter (log)"),
        (axes[1], "tt_bytes", "TT bytes, the schedule's size (log)"),
    ):
        for label, group in sorted(groups.items()):
            keyed: dict[Any, list[dict[str, Any]]] = {}
            for row in group:
                keyed.setdefault(row["setting"], []).append(row)
            points = sorted((mean([r[key] for r in rs]), mean([r["auc"] for r in rs])) for rs in keyed.values())
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], "o-" if label == "fixed rank" else "s--", label=label
            )
            ax.scatter([r[key] for r in group], [r["auc"] for r in group], s=8, alpha=0.4)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("validation AUC")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(
    rows: list[dict[str, Any]], key: str, fixed_ranks: list[int], starts: list[int], targets: list[float]
) -> list[dict[str, Any]]:
    """Per adaptive setting (means over seeds): the size on axis ``key``, the AUC, the fixed
    curve there and the difference."""
    fixed_points = []
    for r in fixed_ranks:
        rs = [x for x in rows if x["kind"] == "fixed" and x["start"] == r]
        fixed_points.append((mean([x[key] for x in rs]), mean([x["auc"] for x in rs])))
    out = []
    for r in starts:
        for t in targets:
            rs = [x for x in rows if x["kind"] == "adaptive" and x["start"] == r and x.get("target") == t]
            size, auc = mean([x[key] for x in rs]), mean([x["auc"] for x in rs])
            ref = interpolate_fixed(fixed_points, size)
            out.append(
                {
                    "start": r,
                    "target_ratio": t,
                    "size": size,
                    "auc": auc,
                    "fixed_auc_at_size": ref,
                    "difference": None if ref is None else auc - ref,
                }
            )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="trainer.seed of each repeat")
    parser.add_argument("--fixed", type=int, nargs="+", default=[2, 4, 8, 12, 16, 32], help="fixed ranks")
    parser.add_argument("--starts", type=int, nargs="+", default=[16, 32], help="starting ranks of adaptive runs")
    parser.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[0.5, 0.25, 0.1, 0.05],
        help="size targets as ratios of the starting model's size",
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each gets cores / jobs threads)")
    parser.add_argument("--out", default="runs/bench_rank", help="folder for the runs, front.png, front.json")
    parser.add_argument("--rerun", action="store_true", help="run again the settings whose summary.json exists")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = parser.parse_args(argv)

    config, preset_overrides = PRESETS[args.preset]
    out = Path(args.out).resolve() / args.preset
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    specs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for r in args.fixed:
            specs.append(
                {
                    "kind": "fixed",
                    "setting": f"fixed r{r}",
                    "start": r,
                    "seed": seed,
                    "overrides": [f"model.rank={r}", f"model.mlp_rank={r}", "schedule.enabled=false"],
                }
            )
        for r in args.starts:
            for t in args.targets:
                specs.append(
                    {
                        "kind": "adaptive",
                        "setting": f"r{r} -> {t:g}",
                        "start": r,
                        "target": t,
                        "seed": seed,
                        "overrides": [
                            f"model.rank={r}",
                            f"model.mlp_rank={r}",
                            "schedule.enabled=true",
                            "schedule.mode=budget",
                            f"schedule.target_size_ratio={t}",
                        ],
                    }
                )
    print(
        f"bench_rank: preset {args.preset} ({config}), {len(specs)} runs, {args.jobs} at a time x {threads} thread(s)",
        flush=True,
    )

    def launch(spec: dict[str, Any]) -> dict[str, Any]:
        name = f"{spec['setting'].replace(' -> ', '_to_').replace(' ', '_')}_s{spec['seed']}"
        overrides = preset_overrides + spec["overrides"] + [f"trainer.seed={spec['seed']}"] + args.overrides
        summary = run_one(config, overrides, out / name, threads, args.rerun)
        row = summary_row(spec, summary, out / name)
        print(
            f"  done {spec['setting']:>14} seed {spec['seed']}: {row['model_bytes']:>10,} B model, "
            f"{row['tt_bytes']:>10,} B TT  AUC {row['auc']:.4f}  {row['wall_s']:.0f} s",
            flush=True,
        )
        return row

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(launch, specs))

    # the fixed runs at each start rank give the adaptive runs' starting TT size
    start_tt = {r: mean([x["tt_bytes"] for x in rows if x["kind"] == "fixed" and x["start"] == r]) for r in args.fixed}
    print("\n| run | seed | model bytes | TT bytes | val AUC | wall s | live ranks |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['setting']} | {row['seed']} | {row['model_bytes']:,} | {row['tt_bytes']:,} | {row['auc']:.4f} "
            f"| {row['wall_s']:.0f} | {short_ranks(row['live_ranks'])} |"
        )

    by_model = compare(rows, "model_bytes", args.fixed, args.starts, args.targets)
    by_tt = compare(rows, "tt_bytes", args.fixed, args.starts, args.targets)
    print("\nadaptive (mean over seeds) against the fixed-rank curve at the same size:")
    print(
        "| adaptive | target TT bytes | TT bytes | off target | val AUC | model bytes | fixed curve there | "
        "difference | fixed curve at the TT bytes | difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def fmt(ref: Optional[float], diff: Optional[float]) -> str:
        return f"{ref:.4f} | {diff:+.4f}" if ref is not None and diff is not None else "outside the fixed range | -"

    for m, t in zip(by_model, by_tt):
        target = m["target_ratio"] * start_tt[m["start"]] if m["start"] in start_tt else float("nan")
        m["target_tt_bytes"], m["tt_bytes"] = target, t["size"]
        m["off_target"] = t["size"] / target - 1 if target == target else None
        m["fixed_auc_at_tt_bytes"], m["difference_tt_axis"] = t["fixed_auc_at_size"], t["difference"]
        off = f"{100 * m['off_target']:+.1f}%" if m["off_target"] is not None else "-"
        print(
            f"| r{m['start']} -> {m['target_ratio']:g} | {target:,.0f} | {t['size']:,.0f} | {off} | {m['auc']:.4f} | "
            f"{m['size']:,.0f} | {fmt(m['fixed_auc_at_size'], m['difference'])} | "
            f"{fmt(t['fixed_auc_at_size'], t['difference'])} |"
        )
    (out / "front.json").write_text(json.dumps({"preset": args.preset, "runs": rows, "adaptive": by_model}, indent=1))
    plot_front(rows, out / "front.png", f"accuracy-size front, {args.preset} ({len(args.seeds)} seeds)")
    print(f"\nwrote {out / 'front.png'} and {out / 'front.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
