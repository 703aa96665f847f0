"""launch/bench_gpu.py on CPU: the table list it carries and a smoke run."""

from __future__ import annotations

import json

from comera_rec.dlrm.config import DLRMConfig
from launch import bench_gpu


def test_carried_kaggle_tables_are_the_ones_the_dlrm_config_compresses() -> None:
    cfg = DLRMConfig.kaggle()
    compressed = [n for n in cfg.table_sizes if n * cfg.embedding_dim >= cfg.min_params_to_compress]
    assert bench_gpu.KAGGLE_COMPRESSED_SIZES == compressed and bench_gpu.EMBEDDING_DIM == cfg.embedding_dim


def test_quick_run_prints_one_row_per_variant(capsys) -> None:
    bench_gpu.main(["--quick", "--device", "cpu"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    lookups = {r["variant"]: r for r in rows if r.get("bench") == "lookup_step"}
    # on CPU: no Triton and no CUDA graph; the static lookup still runs
    assert set(lookups) == {"dense", "tt_torch", "tt_static"}
    assert lookups["dense"]["vs_dense"] == 1.0 and all(r["ms"] > 0 for r in lookups.values())
    assert lookups["tt_torch"]["param_bytes"] < lookups["dense"]["param_bytes"]
    assert {r["variant"] for r in rows if r.get("bench") == "linear_fwd_bwd"} == {"dense", "tt"}


def test_quick_scoring_run_scores_the_same_rows_on_every_tt_path(capsys) -> None:
    bench_gpu.main(["--quick", "--device", "cpu", "--score"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    lookups = [r for r in rows if r.get("bench") == "lookup_score"]
    # on CPU: no Triton and no graphs; one row per variant and batch
    assert sorted((r["batch"], r["variant"]) for r in lookups) == [
        (b, v) for b in (1, 64) for v in ("dense", "tt_static", "tt_torch")
    ]
    for r in lookups:
        assert r["ms"] > 0 and r["rows_per_s"] > 0
        if r["variant"] != "dense":  # the static lookup scores what the de-duplicated one does
            assert r["max_abs_diff_vs_tt_torch"] <= 1e-5
    layers = {(r["batch"], r["variant"]) for r in rows if r.get("bench") == "linear_score"}
    assert layers == {(b, v) for b in (1, 64) for v in ("dense", "tt")}
