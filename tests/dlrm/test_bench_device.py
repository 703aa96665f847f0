from __future__ import annotations

import json

import pytest
import torch
from torchrec.datasets.utils import Batch

from comera_rec.dlrm.bench_device import config, main, plain_optimizers, run_variant
from comera_rec.dlrm.model import build_dlrm_train


@pytest.mark.parametrize("plain", [False, True])
def test_tiny_variants_run_on_cpu(plain: bool) -> None:
    rows = [run_variant(v, torch.device("cpu"), 64, 2, 1, 4, tiny=True, plain=plain) for v in ("dense", "tt")]
    assert [r["variant"] for r in rows] == (["dense_plain", "tt_plain"] if plain else ["dense", "tt"])
    for r in rows:
        assert r["step_ms"] > 0 and r["samples_per_s"] > 0 and r["peak_device_bytes"] is None
        assert 0.0 < r["loss"] < 5.0


def test_main_prints_one_json_line_per_variant(capsys) -> None:
    main(["--device", "cpu", "--tiny", "--plain", "--batch-size", "32", "--steps", "1", "--warmup", "0"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["variant"] for r in lines] == ["dense_plain", "tt_plain"]


@pytest.mark.parametrize("variant", ["dense", "tt"])
def test_graphed_plain_step_has_no_host_sync_and_trains(variant: str) -> None:
    """On CPU the graphed variant replays through the eager stand-in under the host-sync
    check: the whole DLRM step (static lookups, AdamW) is capturable as written."""
    graphed = run_variant(variant, torch.device("cpu"), 64, 3, 2, 4, tiny=True, plain=True, graphed=True)
    eager = run_variant(variant, torch.device("cpu"), 64, 3, 2, 4, tiny=True, plain=True)
    assert graphed["variant"] == f"{variant}_plain_graphed"
    assert graphed["loss"] == pytest.approx(eager["loss"], rel=1e-4)


def test_graphed_needs_plain() -> None:
    with pytest.raises(ValueError, match="plain"):
        run_variant("tt", torch.device("cpu"), 64, 1, 0, 4, tiny=True, graphed=True)


@pytest.mark.filterwarnings("error::UserWarning")  # torch's notice on sparse invariant checks included
def test_sparse_tables_update_only_touched_rows() -> None:
    """With sparse tables each dense table gets a sparse gradient, and Adagrad leaves the rows
    no sample looked up as they were (as FBGEMM's fused optimiser does)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(0)
    model = build_dlrm_train(config("dense", 4, tiny=True))
    optims = plain_optimizers(model, sparse_tables=True, capturable=False)
    assert [type(o).__name__ for o in optims] == ["AdamW", "Adagrad"]
    table = model.model.sparse_arch.embedding_bag_collection.embedding_bags["t_cat_0"]
    before = table.weight.detach().clone()
    keys = [f"cat_{i}" for i in range(26)]
    ids = torch.tensor([3, 7] * 26)  # rows 3 and 7 of every table
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=torch.ones(52, dtype=torch.long))
    loss, _ = model(Batch(torch.rand(2, 13), kjt, torch.tensor([0, 1])))
    loss.backward()
    assert table.weight.grad.is_sparse
    for o in optims:
        o.step()
    changed = (table.weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 7]


def test_sparse_tables_need_plain_eager_steps() -> None:
    sparse = run_variant("dense", torch.device("cpu"), 64, 2, 1, 4, tiny=True, plain=True, sparse_tables=True)
    assert sparse["variant"] == "dense_plain_sparse" and 0.0 < sparse["loss"] < 5.0
    with pytest.raises(ValueError, match="sparse_tables"):
        run_variant("dense", torch.device("cpu"), 64, 1, 0, 4, tiny=True, plain=True, graphed=True, sparse_tables=True)


def test_sparse_tables_keep_invariant_checks_a_process_turned_on() -> None:
    torch.sparse.check_sparse_tensor_invariants.enable()
    try:
        plain_optimizers(build_dlrm_train(config("dense", 4, tiny=True)), sparse_tables=True, capturable=False)
        assert torch.sparse.check_sparse_tensor_invariants.is_enabled()
    finally:
        torch.sparse.check_sparse_tensor_invariants.disable()
