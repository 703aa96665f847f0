"""The compiled-against-eager benchmark (comera_rec/dlrm/bench_compile.py): the compressed
model's dense parts compile to whole graphs, the eager parts are back in place afterwards,
and the table sets each variant against its own eager step."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torchrec.models.dlrm import DLRM

from comera_rec.dlrm import bench_compile
from comera_rec.dlrm.bench import main
from comera_rec.dlrm.bench_setup import Setup

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py

SETUP = replace(Setup(), batch_size=64)


def test_compressed_dense_parts_compile_whole_and_are_timed_both_ways(monkeypatch, capsys) -> None:
    built = []
    original = bench_compile.build
    monkeypatch.setattr(bench_compile, "build", lambda *a, **k: built.append(original(*a, **k)) or built[-1])
    results = bench_compile.compile_table(SETUP, ("tt",), backend="aot_eager", blocks=2, warmup=1)
    r = results["tt"]
    assert r["graphs"] == 3 and r["graph_breaks"] == 0  # one graph per dense part
    assert r["eager_s"] > 0 and r["compiled_s"] > 0
    dlrm = next(m for m in built[0][0].modules() if isinstance(m, DLRM))
    for name in bench_compile.DENSE_PARTS:  # the eager modules back in place
        assert not hasattr(getattr(dlrm, name), "_orig_mod"), name
    out = capsys.readouterr().out
    assert "tt " in out and "compiled/eager" in out and "eager vs dense" not in out  # no dense baseline asked for


@pytest.mark.parametrize("other", [["--parts"], ["--against", "HEAD"], ["--autocast"]])
def test_compile_is_refused_with_the_other_modes(other: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--compile", *other])
    assert "--compile times the Kaggle training step" in capsys.readouterr().err
