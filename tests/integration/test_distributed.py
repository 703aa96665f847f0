"""wrap_model / rewrap_after_truncation, and two-process DMP equivalence with one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

from comera_rec.integration.distributed import (
    EmbeddingOptimizerSpec,
    rewrap_after_truncation,
    wrap_model,
)
from tests.integration import dmp_worker as worker

ROOT = Path(__file__).resolve().parents[2]


def _reference() -> dict[str, torch.Tensor]:
    """One process, whole global batch, same optimizers (tables updated in backward)."""
    model = worker.build_model()
    wrapped, optim = wrap_model(
        model, device="cpu", make_dense_optimizer=worker.sgd,
        embedding_optimizer=EmbeddingOptimizerSpec(torch.optim.SGD, {"lr": worker.LR}),
    )
    wrapped, optim = worker.train(wrapped, optim, model, rank=0, world=1)
    return {k: v.detach().clone() for k, v in wrapped.state_dict().items()}


def test_single_process_wrap_and_rewrap_keeps_state() -> None:
    model = worker.build_model()
    wrapped, optim = wrap_model(model, device="cpu")
    ebc = model.model.sparse_arch.embedding_bag_collection
    # one process: the dense tables run FBGEMM's kernels, updated inside backward
    assert isinstance(ebc.dense, FusedEmbeddingBagCollection)
    assert optim.fused is not None
    table = ebc.dense.embedding_bags["t_cat_2"].weight
    assert all(p is not table for ps in optim.groups.values() for p in ps)
    before = table.detach().clone()
    loss, _ = wrapped(worker.make_batch(0))
    loss.backward()
    optim.step()
    optim.zero_grad()
    assert not torch.equal(before, table.detach())
    mlp_weight = model.model.over_arch.model[1].weight
    assert mlp_weight in optim.dense.state
    assert worker.kill_and_truncate(model)
    wrapped, new = rewrap_after_truncation(wrapped, optim)
    assert new.dense.state[mlp_weight] is optim.dense.state[mlp_weight]  # unchanged params keep state
    cores = {id(p) for p in ebc.groups[0].cores}
    assert cores <= {id(p) for p in new.groups["cores"]}
    loss, _ = wrapped(worker.make_batch(1))
    loss.backward()
    new.step()


@pytest.mark.slow
def test_two_process_dmp_matches_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         str(ROOT / "tests" / "integration" / "dmp_worker.py"), str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    expected = _reference()

    # replicated parameters (TT cores, controllers, MLPs): equal on both ranks and to the reference
    for name, value in ranks[0]["replicated"].items():
        torch.testing.assert_close(ranks[1]["replicated"][name], value, rtol=0, atol=0)
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    truncated = ranks[0]["replicated"]["model.sparse_arch.embedding_bag_collection.groups.0.controllers.0"]
    assert truncated.shape[-1] == 2  # one slice of rank 3 was cut mid-run

    # sharded dense tables: put the shards together
    seen = set()
    for r in ranks:
        for name, offsets, shard in r["shards"]:
            full = expected[name]
            rows, cols = shard.shape
            torch.testing.assert_close(
                shard, full[offsets[0] : offsets[0] + rows, offsets[1] : offsets[1] + cols],
                rtol=1e-5, atol=1e-6, msg=name,
            )
            seen.add(name)
    assert {n.rsplit(".", 2)[-2] for n in seen} == {"t_cat_2", "t_cat_3"}
    # the tables were sharded: each rank holds one of them
    assert all(len(r["shards"]) == 1 for r in ranks)
