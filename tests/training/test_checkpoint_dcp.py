"""The shared (DCP) part of checkpoints in one process: layout and checksums, weights-only
metadata, optimiser state by parameter name, row-wise state conversion, the export."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from comera_rec.rank import resize_to_state_dict
from comera_rec.tensor import TTLinear
from comera_rec.training import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from comera_rec.training.checkpoint import export_model_state, main
from comera_rec.training.dcp_state import (
    convert_rowwise,
    fill_skeleton,
    load_optimizer_state,
    optimizer_state,
    split_tensors,
    tensor_shapes,
)


def _shared(step: int) -> dict:
    v = float(step)
    return {
        "model": {"lin.w": torch.full((4, 3), v), "ids": torch.arange(5)},
        "optimizer": {"state": {"lin.w": {"exp_avg": torch.full((4, 3), -v)}}, "param_groups": [{"lr": 0.1}]},
    }


def _save(root: Path, step: int) -> Path:
    return save_checkpoint(root, step, {"trainer": {"step": step}, "t": (1, None)}, {}, keep=0, shared=_shared(step))


def test_shared_state_round_trips_with_checksums(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", 3)
    meta = json.loads((path / "meta.json").read_text())
    assert set(meta["shared"]["files"]) == {".metadata", "__0_0.distcp"} == set(meta["shared"]["sha256"])
    assert {p.name for p in path.iterdir()} == {"meta.json", "rank0.pt", "shared"}  # no sidecars left
    state, _ = load_checkpoint(path)
    assert state["trainer"]["step"] == 3 and state["t"] == (1, None)
    assert torch.equal(state["model"]["lin.w"], torch.full((4, 3), 3.0))
    assert torch.equal(state["model"]["ids"], torch.arange(5))
    assert torch.equal(state["optimizer"]["state"]["lin.w"]["exp_avg"], torch.full((4, 3), -3.0))
    assert state["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert tensor_shapes(path / "shared")["model/lin.w"] == (torch.Size([4, 3]), torch.float32)


def test_damaged_shared_file_is_skipped_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    good, bad = _save(root, 1), _save(root, 2)
    data = bytearray((bad / "shared" / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "shared" / "__0_0.distcp").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="comera_rec.training.checkpoint"):
        assert latest_checkpoint(root) == good
    assert any("SHA-256 of shared/__0_0.distcp" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="shared/__0_0.distcp"):
        load_checkpoint(bad)
    (good / "shared" / ".metadata").unlink()  # a missing DCP file: incomplete
    assert latest_checkpoint(root) is None


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_metadata_naming_other_types_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    path = _save(tmp_path / "ckpt", 1)
    meta_file = path / "shared" / ".metadata"
    meta_file.write_bytes(pickle.dumps(_Payload(marker)))
    meta = json.loads((path / "meta.json").read_text())
    meta["shared"] = {"files": {".metadata": meta_file.stat().st_size, "__0_0.distcp": 0}}
    meta["shared"]["files"]["__0_0.distcp"] = (path / "shared" / "__0_0.distcp").stat().st_size
    (path / "meta.json").write_text(json.dumps(meta))  # no checksums: as an attacker would write it
    assert latest_checkpoint(tmp_path / "ckpt") == path
    with pytest.raises(pickle.UnpicklingError, match="not a DCP record type"):
        load_checkpoint(path)
    assert not marker.exists()


def test_skeleton_round_trip() -> None:
    state = {"a": [torch.ones(2), 3, (None, torch.zeros(1))], "b": {"c": "x"}}
    skeleton, flat = split_tensors(state, "s")
    assert sorted(flat) == ["s/a/0", "s/a/2/1"] and skeleton["b"] == {"c": "x"}
    back = fill_skeleton(skeleton, flat)
    assert back["a"][0] is state["a"][0] and back["a"][1] == 3 and back["a"][2][0] is None


def test_optimizer_state_is_matched_by_parameter_name() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    saved = optimizer_state(opt, model)
    assert set(saved["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    # the same parameters handed to a new optimiser in another order
    fresh = torch.optim.AdamW(list(model.parameters())[::-1], lr=0.5)
    load_optimizer_state(fresh, model, saved)
    assert fresh.param_groups[0]["lr"] == 0.01
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_rowwise_state_between_column_plans() -> None:
    rows = 3
    tw = torch.tensor([1.0, 2.0, 3.0])
    # one shard of 8 columns -> two of 4: each shard starts from the row's value
    assert torch.equal(convert_rowwise(tw, rows, [8], [4, 4]), torch.cat([tw, tw]))
    # two shards of 2 and 6 columns -> one: the width-weighted mean (exact for Adagrad's
    # row-wise mean of squared gradients)
    cw = torch.tensor([1.0, 2.0, 3.0, 5.0, 6.0, 7.0])
    want = (2 * cw[:3] + 6 * cw[3:]) / 8
    assert torch.allclose(convert_rowwise(cw, rows, [2, 6], [8]), want)
    with pytest.raises(ValueError, match="only table-wise and column-wise"):
        convert_rowwise(torch.ones(5), rows, [8], [4, 4])


def test_export_gives_a_plain_state_dict_for_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TTLinear(16, 8, rank=3)
    shared = {"model": model.state_dict()}
    path = save_checkpoint(tmp_path / "ckpt", 5, {}, {}, shared=shared)
    out = tmp_path / "model.pt"
    main(["export", str(tmp_path / "ckpt"), str(out)])
    sd = torch.load(out, weights_only=True)
    fresh = TTLinear(16, 8, rank=3)
    fresh.load_state_dict(sd)
    x = torch.randn(2, 16)
    assert torch.equal(fresh(x), model(x))
    assert export_model_state(path).keys() == sd.keys()


class _Wrapped:
    """An extra optimiser of another kind (as LTE's): a torch optimiser inside, plus counters."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        self.steps = 0

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "steps": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd["inner"])
        self.steps = int(sd["steps"])


def test_trainer_state_round_trips_through_the_shared_part(tmp_path: Path) -> None:
    from comera_rec.training.checkpoint import SHARED_KEY
    from comera_rec.training.dcp_state import restore_shared, shared_model_shapes, shared_state

    def build() -> tuple[nn.Module, torch.optim.Optimizer, _Wrapped]:
        model = nn.Sequential(TTLinear(16, 8, rank=4), nn.Linear(8, 1))
        return model, torch.optim.AdamW(model[0].parameters(), lr=0.01), _Wrapped(list(model[1].parameters()))

    torch.manual_seed(0)
    model, opt, extra = build()
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        extra.inner.step()
        extra.steps += 1
    model[0].cores[0] = nn.Parameter(model[0].cores[0].detach()[..., :2].clone())  # a cut rank, by hand
    model[0].cores[1] = nn.Parameter(model[0].cores[1].detach()[:2].clone())
    path = save_checkpoint(tmp_path / "ckpt", 2, {}, {}, shared=shared_state(model, None, [extra]))

    fresh, fresh_opt, fresh_extra = build()
    state, _ = load_checkpoint(path, shared=False)
    skeleton = state[SHARED_KEY]
    shapes = shared_model_shapes(path, skeleton)
    assert tuple(shapes["0.cores.0"].shape)[-1] == 2 and shapes["0.cores.0"].device.type == "meta"
    resize_to_state_dict(fresh, shapes)
    restore_shared(path, skeleton, fresh, None, [fresh_extra])
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert fresh_extra.steps == 2
    for p, q in zip(model[1].parameters(), fresh[1].parameters()):
        assert torch.equal(extra.inner.state[p]["momentum_buffer"], fresh_extra.inner.state[q]["momentum_buffer"])
