"""The serving benchmark's smoke run (comera_rec.dlrm.serving, launch/bench_serving.py --quick):
every variant measured in its own process, every figure positive, the table complete."""

from __future__ import annotations

import re

import pytest

from comera_rec.dlrm import serving


def test_quick_run_measures_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    report = serving.main(["--quick", "--iters", "3", "--warmup", "1"])
    out = capsys.readouterr().out
    assert report.setup.quick and report.setup.start_method == "spawn"
    assert set(report.results) == set(serving.VARIANTS)
    for variant, result in report.results.items():
        assert result["file_bytes"] > 0 and result["load_s"] > 0
        assert result["peak"] >= result["base"] > 0
        assert set(result["batch"]) == set(report.setup.batch_sizes)
        for b, figures in result["batch"].items():
            assert figures["rows_s"] > 0, (variant, b)
            assert 0 < figures["p50_s"] <= figures["p99_s"], (variant, b)
            assert figures["cpu_rows_s"] > 0 and figures["cpu_p50_s"] >= 0, (variant, b)
        # one table row per batch size, and one in the file / RSS table
        rows = re.findall(rf"^\| {variant} \| (\d+) \|", out, flags=re.M)
        assert sorted(int(r) for r in rows) == sorted(report.setup.batch_sizes)
        assert re.search(rf"^\| {variant} \| [\d.]+ [KMG]?B \|", out, flags=re.M), out
    # the exported programs give the eager logits
    for kind in ("dense", "tt"):
        assert report.prepared[kind]["max_abs_diff"] < 1e-5
    # ratios against dense_eager: 1.00x for itself
    assert re.search(r"^\| dense_eager \| 1 \| [\d,]+ \| 1\.00x \|", out, flags=re.M)
    # the compressed tables are smaller on disk
    assert report.results["tt_eager"]["file_bytes"] < report.results["dense_eager"]["file_bytes"]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        serving.main(["--iters", "0"])
    with pytest.raises(SystemExit):
        serving.main(["--mlperf", "--quick"])
    with pytest.raises(SystemExit):  # the dense MLPerf model cannot be built on such a host
        serving.main(["--mlperf", "--variants", "dense_eager", "tt_eager"])


def test_mlperf_shapes_are_compressed_dcn_models() -> None:
    from comera_rec.dlrm.config import MLPERF_TABLE_SIZES
    from comera_rec.dlrm.serving_setup import ServingSetup, model_config

    setup = ServingSetup(mlperf=True)
    tt, dense = model_config("tt", setup), model_config("dense", setup)
    assert tt.compressed and not dense.compressed
    assert tt.interaction == dense.interaction == "dcn" and tt.embedding_dim == 128
    assert list(tt.table_sizes) == list(MLPERF_TABLE_SIZES)
