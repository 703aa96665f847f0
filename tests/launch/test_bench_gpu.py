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
