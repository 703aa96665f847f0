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
    out = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "train", "loss"), label="train loss")
    ax.plot(*_series(records, "eval", "log_loss"), "o-", label="validation log loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(*_series(records, "eval", "auc"), "s-", color="tab:green", label="validation AUC")
    ax2.set_ylabel("AUC")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best")
    ax.set_title("loss and AUC")
    fig.tight_layout()
    path = run_dir / "loss_auc.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "train", "live_rank"), label="sum of live ranks")
    ax.set_xlabel("step")
    ax.set_ylabel("live ranks")
    ax2 = ax.twinx()
    ax2.plot(*_series(records, "train", "compression"), color="tab:red", label="compression ratio")
    ax2.set_ylabel("compression ratio (dense / live parameters)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best")
    ax.set_title("ranks and compression")
    fig.tight_layout()
    path = run_dir / "ranks_compression.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)
    return out


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
