"""launch/predict_dlrm.py: scores of a trained tiny run on the Criteo sample, checked
against the trainer's own evaluation of the same checkpoint on the same rows."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Iterator

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml

from comera_rec.dlrm.predict import (
    CheckpointConfigMismatchError,
    CheckpointNotFoundError,
    find_checkpoint,
    join_parts,
    part_path,
)
from launch.predict_dlrm import main as predict_main
from launch.train_dlrm import main as train_main
from tests.dlrm.tiny import TABLE_SIZES, TINY
from tests.reliability.helpers import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path("/work/shared/data/criteo_sample_200.tsv")


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[Path, dict]]:
    """A 3-step tiny run trained and validated on the 200 sample rows: (run dir, summary)."""
    if not SAMPLE.is_file():
        pytest.skip(f"{SAMPLE} is not on this machine")
    with tempfile.TemporaryDirectory(prefix="predict-dlrm-") as tmp:
        run_dir = Path(tmp) / "run"
        summary = train_main(
            [
                "--config",
                str(ROOT / "configs/dlrm_demo.yaml"),
                *TINY,
                "data.source=tsv",
                f"data.train_paths=[{SAMPLE}]",
                f"data.val_paths=[{SAMPLE}]",
                "data.holdout=none",
                "data.bad_input=strict",
                "data.batch_size=64",
                f"data.num_embeddings_per_feature=[{','.join(map(str, TABLE_SIZES))}]",
                "trainer.max_steps=3",
                "trainer.plots=false",
                "trainer.device=cpu",
                f"trainer.run_dir={run_dir}",
            ]
        )
        yield run_dir, summary


def _printed(out: str, name: str) -> float:
    match = re.search(rf"{name} ([0-9.]+)", out)
    assert match, out
    return float(match.group(1))


def test_auc_and_log_loss_equal_the_trainers_evaluation(run: tuple[Path, dict], capsys: pytest.CaptureFixture) -> None:
    run_dir, summary = run
    out = run_dir.parent / "scores.parquet"
    result = predict_main(
        ["--checkpoint", str(run_dir), str(SAMPLE), "--out", str(out), "--batch-size", "48", "--no-progress"]
    )
    printed = capsys.readouterr().out
    assert summary["truncations"] >= 1  # the checkpoint's ranks are below the built model's: resized on load
    assert _printed(printed, "AUC") == pytest.approx(summary["val_auc"], abs=1e-6)
    assert _printed(printed, "log loss") == pytest.approx(summary["val_log_loss"], abs=1e-6)
    assert result["count"] == result["rows"] == 200
    table = pq.read_table(out)
    assert table.column_names == ["score", "label"] and table.num_rows == 200
    labels = [int(line.split("\t", 1)[0]) for line in SAMPLE.read_text().splitlines()]
    assert table.column("label").to_pylist() == labels  # one output row per input row, in order
    scores = table.column("score").to_pylist()
    assert all(0.0 < s < 1.0 for s in scores)
    out.unlink()


def test_unlabelled_rows_to_csv(run: tuple[Path, dict], capsys: pytest.CaptureFixture) -> None:
    run_dir, _ = run
    folder = run_dir.parent
    unlabelled = folder / "test.txt"  # Kaggle test.txt layout: no label column
    unlabelled.write_text("".join(line.split("\t", 1)[1] + "\n" for line in SAMPLE.read_text().splitlines()))
    step = find_checkpoint(run_dir)
    labelled_out, csv_out = folder / "a.parquet", folder / "b.csv"
    predict_main(["--checkpoint", str(step / "rank0.pt"), str(SAMPLE), "--out", str(labelled_out), "--no-progress"])
    predict_main(["--checkpoint", str(step), str(unlabelled), "--out", str(csv_out), "--no-progress"])
    assert "AUC" not in capsys.readouterr().out.split("b.csv")[-1]
    table = pacsv.read_csv(csv_out)
    assert table.column_names == ["score"]
    assert table.column("score").to_pylist() == pytest.approx(
        pq.read_table(labelled_out).column("score").to_pylist(), abs=1e-6
    )
    for p in (unlabelled, labelled_out, csv_out):
        p.unlink()


def test_checkpoint_forms_resolve_to_the_same_folder(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    step = find_checkpoint(run_dir)
    assert step.parent == run_dir / "checkpoints" and step.name.startswith("step_")
    assert (
        find_checkpoint(run_dir / "checkpoints") == find_checkpoint(step) == find_checkpoint(step / "rank0.pt") == step
    )


def test_missing_checkpoint_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        predict_main(["--checkpoint", str(tmp_path / "nowhere"), str(SAMPLE), "--out", str(tmp_path / "s.csv")])
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)  # a folder, but nothing trained in it
    assert isinstance(CheckpointNotFoundError("x"), FileNotFoundError)


def test_config_that_does_not_match_the_checkpoint_is_a_named_error(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    saved = json.loads((find_checkpoint(run_dir) / "meta.json").read_text())["config"]
    saved["model"]["rank"] = 8  # the run used rank 4
    config = run_dir.parent / "other.yaml"
    config.write_text(yaml.safe_dump(saved))
    out = run_dir.parent / "never.parquet"
    with pytest.raises(CheckpointConfigMismatchError, match=r"model\.rank \(checkpoint 4, now 8\)"):
        predict_main(["--checkpoint", str(run_dir), "--config", str(config), str(SAMPLE), "--out", str(out)])
    assert not out.exists()
    config.unlink()


@pytest.mark.slow
def test_two_processes_write_the_rows_of_one_in_input_order(run: tuple[Path, dict], tmp_path: Path) -> None:
    run_dir, summary = run
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    predict_main(["--checkpoint", str(run_dir), str(SAMPLE), "--out", str(one), "--batch-size", "48", "--no-progress"])
    args = ["--checkpoint", str(run_dir), str(SAMPLE), "--out", str(two), "--batch-size", "48", "--no-progress"]
    proc = run_torchrun(ROOT / "launch/predict_dlrm.py", args, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr  # clean gloo shutdown
    # the metrics are over both processes' rows: the trainer's own evaluation of the checkpoint
    assert _printed(proc.stdout, "AUC") == pytest.approx(summary["val_auc"], abs=1e-6)
    assert "scored 200 rows" in proc.stdout and proc.stdout.count("AUC") == 1  # printed by rank 0 only
    a, b = pq.read_table(one), pq.read_table(two)
    assert b.column("label").to_pylist() == a.column("label").to_pylist()  # every row once, in input order
    assert b.column("score").to_pylist() == pytest.approx(a.column("score").to_pylist(), abs=1e-6)
    assert sorted(p.name for p in tmp_path.glob("two*")) == ["two.parquet"]  # the part files are gone


def test_csv_parts_join_as_text_and_empty_parts_drop_out(tmp_path: Path) -> None:
    out = tmp_path / "s.csv"
    parts = [part_path(out, r) for r in range(3)]
    parts[0].write_text('"score"\n')  # a process with no rows: its part has no label column
    parts[1].write_text('"score","label"\n0.25,1\n0.5,0\n')
    parts[2].write_text('"score","label"\n0.125,1\n')
    join_parts(parts, out)
    assert out.read_text() == '"score","label"\n0.25,1\n0.5,0\n0.125,1\n'
    assert not any(p.exists() for p in parts)
