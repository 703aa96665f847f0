"""The DLRM benchmark's batch-size sweep (comera_rec/dlrm/bench_batch.py, ``--batch-sizes``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from comera_rec.dlrm import bench, bench_batch
from comera_rec.dlrm.bench_setup import Setup

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


@pytest.mark.parametrize(("text", "sizes"), [("64", [64]), ("64,256, 2048", [64, 256, 2048]), ("8,", [8])])
def test_parse_sizes(text: str, sizes: list[int]) -> None:
    assert bench_batch.parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "64,x", "0,64", "-8", "1.5"])
def test_parse_sizes_names_bad_input(text: str) -> None:
    with pytest.raises(ValueError, match="batch sizes"):
        bench_batch.parse_sizes(text)


def test_command_line_rejects_bad_sizes(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batch-sizes", "0,64"])
    assert exc.value.code == 2
    assert "--batch-sizes: batch sizes must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--batch-sizes", "64", "--mlperf"])
    assert "--mlperf has no dense model" in capsys.readouterr().err


def test_table_gives_each_variant_against_the_baseline() -> None:
    times = {64: {"dense": 0.005, "tt": 0.010}, 2048: {"dense": 0.060, "tt": 0.024}}
    header, small, large = bench_batch.batch_size_table(times)
    assert header.split() == ["batch", "dense", "tt"]
    assert small.split() == ["64", "5.00", "ms", "(1.00x)", "10.00", "ms", "(0.50x)"]
    assert large.split() == ["2048", "60.00", "ms", "(1.00x)", "24.00", "ms", "(2.50x)"]
    with pytest.raises(ValueError, match="baseline 'dense_fi'"):
        bench_batch.batch_size_table(times, baseline="dense_fi")


def test_faster_from_is_the_size_from_which_every_larger_one_is_faster() -> None:
    times = {
        64: {"dense": 5.0, "tt": 7.0, "tt_half": 4.0, "slow": 9.0},
        256: {"dense": 10.0, "tt": 9.0, "tt_half": 11.0, "slow": 12.0},  # tt_half slower again here
        2048: {"dense": 60.0, "tt": 25.0, "tt_half": 20.0, "slow": 70.0},
    }
    assert bench_batch.faster_from(times) == {"tt": 256, "tt_half": 2048, "slow": None}
    assert bench_batch.faster_from(times, baseline="tt") == {"dense": None, "tt_half": 2048, "slow": None}


def test_times_every_variant_at_every_size() -> None:
    setup = replace(Setup(), batch_size=2048)  # the sweep's sizes, not the setup's, are used
    times = bench_batch.batch_size_times(setup, [8, 32], names=["tt", "tt_half"], steps=2, warmup=1)
    assert list(times) == [8, 32]
    for row in times.values():
        assert list(row) == ["tt", "tt_half"]
        assert all(seconds > 0 for seconds in row.values())


@pytest.mark.parametrize(("sizes", "steps", "warmup"), [([], 2, 1), ([8, 0], 2, 1), ([8], 0, 1), ([8], 2, -1)])
def test_times_reject_bad_arguments(sizes: list[int], steps: int, warmup: int) -> None:
    with pytest.raises(ValueError):
        bench_batch.batch_size_times(Setup(), sizes, names=["tt"], steps=steps, warmup=warmup)
