"""Uneven data across ranks through the DLRM entry point: a TSV whose bad lines (skipped)
all fall in rank 1's part leaves rank 1 fewer batches; both ranks must stop together
instead of rank 1 leaving for evaluation while rank 0 waits in the step's all-reduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comera_rec.data.synthetic import SyntheticCriteo, SyntheticCriteoConfig
from tests.reliability.helpers import TABLE_SIZES, TINY, run_train


@pytest.mark.slow
def test_bad_lines_in_one_ranks_part_do_not_hang(tmp_path: Path) -> None:
    rows = 4096
    path = SyntheticCriteo(SyntheticCriteoConfig(num_rows=rows)).write_tsv(tmp_path / "day_0.tsv", rows)
    lines = path.read_text().splitlines()
    for i in range(rows // 2, rows // 2 + 1500):  # rank 1 reads the second half: 548 good rows of 2048
        lines[i] = "1\t2\t3"  # too few fields: skipped and counted under bad_input: skip
    path.write_text("\n".join(lines) + "\n")
    sizes = ",".join(map(str, TABLE_SIZES))
    run_dir = tmp_path / "run"
    proc = run_train(
        tmp_path,
        [
            *TINY,
            "data.source=tsv",
            f"data.train_paths=[{path}]",
            "data.holdout=none",
            f"data.val_paths=[{path}]",
            f"data.num_embeddings_per_feature=[{sizes}]",
            "table_sizes_from_data=false",
            "data.bad_input=skip",
            "trainer.max_steps=0",
            "trainer.epochs=1",
            "trainer.checkpoint_at_end=false",
            f"trainer.run_dir={run_dir}",
        ],
        nproc=2,
        timeout=240,
    )  # a hang fails here by timeout
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ran out of batches unevenly" in proc.stderr
    assert "rank(s) 1 had none left" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    # batch 256: rank 0 has 8 batches, rank 1 (548 good rows) at most 3; both stop at rank 1's end
    assert summary["world_size"] == 2 and 1 <= summary["steps"] <= 3
