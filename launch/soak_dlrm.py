"""Soak benchmark: a long run of the demo DLRM that reports resident memory over time.

    python launch/soak_dlrm.py --steps 2000 --sample-every 50 [section.key=value ...]

A background thread samples this process's resident set size (VmRSS in /proc/self/status)
each time the trainer passes another ``--sample-every`` steps, then prints a table of the
samples and the growth: the least-squares slope in MB per 1000 steps (over the samples
after the first quarter, which holds the warm-up) and the mean RSS of the first and the
last quarter. The samples are also written to ``RUN_DIR/soak.json``. Not a CI test.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from comera_rec.dlrm.task import DLRMTask, load_run_config
from comera_rec.training import Trainer
from comera_rec.utils.logs import setup_logging

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("VmRSS not found in /proc/self/status")


class RssSampler(threading.Thread):
    """Samples RSS each time ``trainer.step`` reaches the next multiple of ``every``."""

    def __init__(self, trainer: Trainer, every: int, poll_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.trainer, self.every, self.poll_s = trainer, every, poll_s
        self.samples: list[tuple[int, float, float]] = []  # (step, seconds since start, RSS MiB)
        self.stop = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        next_step = 0
        while not self.stop.is_set():
            step = self.trainer.step
            if step >= next_step:
                self.samples.append((step, time.perf_counter() - self.t0, rss_mb()))
                next_step = (step // self.every + 1) * self.every
            time.sleep(self.poll_s)
        self.samples.append((self.trainer.step, time.perf_counter() - self.t0, rss_mb()))


def growth(samples: list[tuple[int, float, float]]) -> dict[str, float]:
    """Slope (MB / 1000 steps) after the first quarter, and first vs last quarter mean RSS."""
    steps = np.array([s[0] for s in samples], dtype=float)
    rss = np.array([s[2] for s in samples])
    q = max(1, len(samples) // 4)
    tail_steps, tail_rss = steps[q:], rss[q:]
    slope = (
        float(np.polyfit(tail_steps, tail_rss, 1)[0] * 1000) if len(tail_steps) > 1 and np.ptp(tail_steps) > 0 else 0.0
    )
    return {
        "slope_mb_per_1000_steps": slope,
        "first_quarter_mb": float(rss[:q].mean()),
        "last_quarter_mb": float(rss[-q:].mean()),
        "last_minus_first_quarter_mb": float(rss[-q:].mean() - rss[:q].mean()),
        "peak_mb": float(rss.max()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", default=str(ROOT / "configs/dlrm_demo.yaml"), help="run config (the demo by default)"
    )
    parser.add_argument("--steps", type=int, default=2000, help="training steps")
    parser.add_argument("--sample-every", type=int, default=50, help="sample RSS every this many steps")
    parser.add_argument("--run-dir", default="runs/soak_dlrm", help="trainer.run_dir")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    config = load_run_config(
        args.config,
        [
            f"trainer.max_steps={args.steps}",
            f"trainer.run_dir={args.run_dir}",
            "trainer.progress=false",
            "trainer.plots=false",
            *args.overrides,
        ],
    )
    trainer = Trainer(DLRMTask(config), config.trainer, config.schedule, config.optim, run_config=config)
    sampler = RssSampler(trainer, args.sample_every)
    sampler.start()
    try:
        summary = trainer.fit()
    finally:
        sampler.stop.set()
        sampler.join()
    result = {
        "steps": args.steps,
        "samples": sampler.samples,
        **growth(sampler.samples),
        "samples_per_s": summary.get("samples_per_s"),
        "wall_s": sampler.samples[-1][1],
    }
    print(f"\n{'step':>7} | {'time s':>8} | {'RSS MB':>8}")
    print("-" * 30)
    for step, t, mb in sampler.samples:
        print(f"{step:>7} | {t:>8.1f} | {mb:>8.1f}")
    print("-" * 30)
    for key in (
        "slope_mb_per_1000_steps",
        "first_quarter_mb",
        "last_quarter_mb",
        "last_minus_first_quarter_mb",
        "peak_mb",
    ):
        print(f"{key:<28} {result[key]:>9.2f}")
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.run_dir) / "soak.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
