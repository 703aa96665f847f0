"""The accuracy-size benchmark (dlrm/bench_rank.py: launch/bench_rank.py, comera-bench-rank): its interpolation and a tiny front end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from comera_rec.dlrm import bench_rank
from tests.dlrm.tiny import TINY


def test_interpolation_is_linear_in_log_bytes_and_refuses_to_extrapolate() -> None:
    fixed = [(1000.0, 0.70), (10000.0, 0.80), (100.0, 0.60)]
    assert bench_rank.interpolate_fixed(fixed, 1000.0) == pytest.approx(0.70)
    assert bench_rank.interpolate_fixed(fixed, 10**3.5) == pytest.approx(0.75)
    assert bench_rank.interpolate_fixed(fixed, 50.0) is None
    assert bench_rank.interpolate_fixed(fixed, 20000.0) is None


@pytest.mark.slow
def test_tiny_front_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [o for o in TINY if not o.startswith(("model.rank", "model.mlp_rank"))]
    overrides += [
        "trainer.max_steps=40",
        "trainer.eval_every=0",
        "trainer.eval_max_batches=2",
        "trainer.checkpoint_at_end=false",
        "trainer.log_every=10",
    ]
    code = bench_rank.main(
        ["--seeds", "0", "--fixed", "2", "4", "--starts", "4", "--targets", "0.5", "--out", str(tmp_path), *overrides]
    )
    assert code == 0
    front = json.loads((tmp_path / "demo" / "front.json").read_text())
    assert {r["setting"] for r in front["runs"]} == {"fixed r2", "fixed r4", "r4 -> 0.5"}
    adaptive = front["adaptive"][0]
    assert abs(adaptive["off_target"]) <= 0.1  # the budget schedule reached its size
    assert (tmp_path / "demo" / "front.png").stat().st_size > 0
    assert "| r4 -> 0.5 |" in capsys.readouterr().out


def test_summary_row_reads_both_sizes_and_refuses_an_old_summary(tmp_path) -> None:
    from comera_rec.dlrm.bench_rank import summary_row

    spec = {"setting": "fixed r4", "seed": 0, "overrides": ["model.rank=4"]}
    summary = {"tt_bytes": 100, "model_bytes": 900, "val_auc": 0.8, "val_log_loss": 0.45, "wall_s": 3.0}
    row = summary_row(spec, summary, tmp_path)
    assert row["tt_bytes"] == 100 and row["model_bytes"] == 900 and "overrides" not in row
    old = {k: v for k, v in summary.items() if k != "tt_bytes"}  # model_bytes meant TT bytes then
    with pytest.raises(ValueError, match="older version.*--rerun"):
        summary_row(spec, old, tmp_path)
