"""Run reports: a JSONL log, PNG plots and a summary table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Union


class JsonlLog:
    """Append-only JSON-lines log; one record per line, each with ``kind`` and ``step``.

    Args:
        path: the log file.
        resume_step: when resuming, records of a later step (written after the
            checkpoint that the run resumes from) are dropped first; None starts a new
            file.

    Example::

        >>> log = JsonlLog(tmp / "log.jsonl")  # doctest: +SKIP
        >>> log.write({"kind": "train", "step": 10, "loss": 0.5})  # doctest: +SKIP
    """

    def __init__(self, path: Union[str, Path], resume_step: Optional[int] = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (non-finite floats are written as null)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")


def read_jsonl(path: Union[str, Path]) -> list[dict[str, Any]]:
    """All records of a JSONL log (an incomplete last line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _series(records: Iterable[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get("kind") == kind and r.get(key) is not None:
            xs.append(int(r["step"]))
            ys.append(float(r[key]))
    return xs, ys


# one line style per curve: (kind, key, legend label, matplotlib format, colour)
Curve = tuple[str, str, str, str, Optional[str]]


def _plot_two_axes(
    plt: Any,
    records: list[dict[str, Any]],
    left: list[Curve],
    right: list[Curve],
    ylabels: tuple[str, str],
    title: str,
    path: Path,
) -> Path:
    """One PNG: ``left`` curves on the left axis, ``right`` ones on a twin axis, one legend."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    for axis, curves in ((ax, left), (ax2, right)):
        for kind, key, label, fmt, color in curves:
            axis.plot(*_series(records, kind, key), fmt, color=color, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabels[0])
    ax2.set_ylabel(ylabels[1])
    lines, lines2 = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(records: list[dict[str, Any]], run_dir: Union[str, Path]) -> list[Path]:
    """Write ``loss_auc.png`` and ``ranks_compression.png`` into ``run_dir``.

    Args:
        records: JSONL records (``kind`` "train" with loss / live_rank / compression,
            ``kind`` "eval" with log_loss / auc).
        run_dir: where the PNGs go.

    Returns:
        The written files.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    return [
        _plot_two_axes(
            plt,
            records,
            [("train", "loss", "train loss", "-", None), ("eval", "log_loss", "validation log loss", "o-", None)],
            [("eval", "auc", "validation AUC", "s-", "tab:green")],
            ("loss", "AUC"),
            "loss and AUC",
            run_dir / "loss_auc.png",
        ),
        _plot_two_axes(
            plt,
            records,
            [("train", "live_rank", "sum of live ranks", "-", None)],
            [("train", "compression", "compression ratio", "-", "tab:red")],
            ("live ranks", "compression ratio (dense / live parameters)"),
            "ranks and compression",
            run_dir / "ranks_compression.png",
        ),
    ]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.4e}"
        return f"{value:.4f}"
    return str(value)


def summary_table(summary: dict[str, Any]) -> str:
    """A two-column text table of a summary dict.

    Example::

        >>> print(summary_table({"steps": 10, "auc": 0.75}))
        metric | value
        -------+-------
        steps  | 10
        auc    | 0.7500
    """
    rows = [(str(k), _fmt(v)) for k, v in summary.items()]
    w1 = max([len("metric")] + [len(k) for k, _ in rows])
    w2 = max([len("value")] + [len(v) for _, v in rows])
    lines = [f"{'metric':<{w1}} | {'value':<{w2}}".rstrip(), f"{'-' * w1}-+-{'-' * w2}"]
    lines += [f"{k:<{w1}} | {v}" for k, v in rows]
    return "\n".join(lines)
