"""How long a resume takes to reach its first step late in a large TSV epoch: the data
position as rows (the reader seeks) against a batch count (the consumed batches are read
again and thrown away), side by side from the same checkpoint.

The tiny DLRM of the tests trains on a generated Criteo TSV of ``--rows`` rows up to
``--step`` (batch ``--batch``), checkpointing there; then each variant resumes a copy of
that run for one more step. Printed: the wall time of each resumed ``fit()`` (start,
restore, data position, one step, a one-batch validation) and of a fresh start to step 1
(the same work without the checkpoint), so that what the position costs is the
difference.

    python launch/bench_resume.py                              # 5M rows, step 2000
    python launch/bench_resume.py --rows 200000 --step 60      # a smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.task import DLRMTask, load_run_config
from comera_rec.training import Trainer
from comera_rec.utils.logs import setup_logging

ROOT = Path(__file__).resolve().parents[1]
TABLES = [20000, 15000, 300, 40, 12000, 7, 500, 60, 3, 900, 20, 11, 50, 4, 1000, 30000, 8, 100, 70, 4, 9000, 10]
TABLES += [12, 800, 90, 200]  # the tests' tiny DLRM (tests/dlrm/tiny.py)


class BatchCountTask(DLRMTask):
    """The DLRM task as a task that cannot tell its data position: a resume skips batches."""

    def train_position(self) -> Optional[dict[str, Any]]:
        return None

    def resume_train_position(self, epoch: int, positions: Sequence[dict[str, Any]]) -> bool:
        return False


def overrides(tsv: Path, run_dir: Path, steps: int, batch: int, resume: bool) -> list[str]:
    sizes = "[" + ",".join(map(str, TABLES)) + "]"
    return [
        f"model.table_sizes={sizes}",
        "model.embedding_dim=8",
        "model.bottom_mlp=[64,32,8]",
        "model.top_mlp=[64,32,1]",
        "model.rank=4",
        "model.mlp_rank=4",
        "model.min_rows_to_compress=10000",
        "model.min_params_to_compress=0",
        "data.source=tsv",
        f"data.train_paths=[{tsv}]",
        "data.holdout=kaggle",
        f"data.batch_size={batch}",
        f"data.num_embeddings_per_feature={sizes}",
        "schedule.enabled=false",
        f"trainer.max_steps={steps}",
        f"trainer.run_dir={run_dir}",
        f"trainer.checkpoint_every={steps if not resume else 0}",
        "trainer.checkpoint_at_end=false",
        "trainer.eval_max_batches=1",
        "trainer.plots=false",
        "trainer.progress=false",
        f"trainer.resume={str(resume).lower()}",
    ]


def timed_fit(task_cls: type, args: list[str]) -> float:
    config = load_run_config(str(ROOT / "configs/dlrm_demo.yaml"), args)
    start = time.perf_counter()
    Trainer(task_cls(config), config.trainer, config.schedule, config.optim, run_config=config).fit()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000, help="rows of the generated TSV")
    parser.add_argument("--step", type=int, default=2000, help="the step the checkpoint is written at")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--dir", default=None, help="work folder (kept, with the TSV, when given)")
    a = parser.parse_args(argv)
    setup_logging()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench_resume_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tsv = work / f"train_{a.rows}.tsv"
        if not tsv.exists():
            t = time.perf_counter()
            gen = SyntheticCriteo(SyntheticCriteoConfig(num_embeddings_per_feature=TABLES, num_rows=a.rows))
            gen.write_tsv(tsv, a.rows)
            print(f"wrote {tsv} ({tsv.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s")
        base = work / "run"
        shutil.rmtree(base, ignore_errors=True)
        t = time.perf_counter()
        timed_fit(DLRMTask, overrides(tsv, base, a.step, a.batch, resume=False))
        print(f"trained to step {a.step} ({a.step * a.batch:,} rows) in {time.perf_counter() - t:.0f} s")
        fresh = work / "fresh"
        shutil.rmtree(fresh, ignore_errors=True)
        results = {"fresh start to step 1": timed_fit(DLRMTask, overrides(tsv, fresh, 1, a.batch, resume=False))}
        for name, task_cls in (("resume, row position", DLRMTask), ("resume, batch count", BatchCountTask)):
            run = work / name.replace(", ", "_").replace(" ", "_")
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(base, run)
            results[name] = timed_fit(task_cls, overrides(tsv, run, a.step + 1, a.batch, resume=True))
        print(f"\nresume at step {a.step} of a {a.rows:,}-row TSV, batch {a.batch} (wall of fit(), one step):")
        for name, s in results.items():
            print(f"  {name:24s} {s:8.2f} s")
        print(
            f"  row position vs batch count: {results['resume, batch count'] / results['resume, row position']:.1f}x "
            "faster to its first step"
        )
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
