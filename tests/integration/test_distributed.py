"""wrap_model / rewrap_data_parallel, and two-process DMP equivalence with one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torchrec.distributed.planner import ParameterConstraints
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from comera_rec.integration.distributed import (
    CPU_SHARDING_TYPES,
    EmbeddingOptimizerSpec,
    dense_table_constraints,
    host_memory_bytes,
    planner_topology,
    replicated_parameter_groups,
    rewrap_data_parallel,
    wrap_model,
)
from comera_rec.rank.size import model_dense_num_parameters, model_num_parameters
from comera_rec.training import OptimConfig, build_optimizer, rebuild_optimizer
from tests.integration import dmp_worker as worker
from tests.integration.helpers import run_two_process_worker


def _reference(table_optimizer: str = "SGD") -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """One process, whole global batch, same optimizers (tables updated in backward): the
    state and the model's (live, dense-equivalent) parameter counts."""
    model = worker.build_model()
    wrapped, _ = wrap_model(model, device="cpu", embedding_optimizer=worker.table_optimizer(table_optimizer))
    optim = worker.sgd(replicated_parameter_groups(wrapped))
    wrapped, optim = worker.train(wrapped, optim, model, rank=0, world=1)
    state = {k: v.detach().clone() for k, v in wrapped.state_dict().items()}
    return state, (model_num_parameters(model), model_dense_num_parameters(model))


def test_single_process_wrap_then_rewrap_and_rebuilt_optimizer_keep_state() -> None:
    model = worker.build_model()
    wrapped, fused = wrap_model(model, device="cpu")
    ebc = model.model.sparse_arch.embedding_bag_collection
    # one process: the dense tables run FBGEMM's kernels, updated inside backward
    assert isinstance(ebc.dense, FusedEmbeddingBagCollection)
    assert fused is not None
    table = ebc.dense.embedding_bags["t_cat_2"].weight

    def replicated() -> list[torch.nn.Parameter]:
        return [p for ps in replicated_parameter_groups(wrapped).values() for p in ps]

    assert all(p is not table for p in replicated())
    optim = build_optimizer(model, OptimConfig(), include=replicated())
    before = table.detach().clone()
    loss, _ = wrapped(worker.make_batch(0))
    loss.backward()
    optim.step()
    optim.zero_grad()
    assert not torch.equal(before, table.detach())
    mlp_weight = model.model.over_arch.model[1].weight
    assert mlp_weight in optim.state
    assert worker.kill_and_truncate(model)
    wrapped = rewrap_data_parallel(wrapped)
    new = rebuild_optimizer(optim, model, OptimConfig(), include=replicated())
    assert new.state[mlp_weight]["exp_avg"] is optim.state[mlp_weight]["exp_avg"]  # unchanged params keep state
    cores = {id(p) for p in ebc.groups[0].cores}
    assert cores <= {id(p) for g in new.param_groups for p in g["params"]}
    loss, _ = wrapped(worker.make_batch(1))
    loss.backward()
    new.step()


@pytest.mark.slow
@pytest.mark.parametrize(
    "sharding, table_optimizer",
    [
        ("table_wise", "SGD"),
        ("column_wise", "SGD"),
        ("planner", "SGD"),
        ("table_wise", "RowWiseAdagrad"),
    ],
)
def test_two_process_dmp_matches_one_process(tmp_path: Path, sharding: str, table_optimizer: str) -> None:
    out = run_two_process_worker(
        "dmp_worker.py", tmp_path, timeout=240, DMP_SHARDING=sharding, DMP_TABLE_OPTIMIZER=table_optimizer
    )
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    expected, sizes = _reference(table_optimizer)
    # the model's size counts whole tables, not this rank's shards
    assert all(r["sizes"] == sizes for r in ranks)

    # replicated parameters (TT cores, controllers, MLPs): equal on both ranks and to the reference
    for name, value in ranks[0]["replicated"].items():
        torch.testing.assert_close(ranks[1]["replicated"][name], value, rtol=0, atol=0)
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    truncated = ranks[0]["replicated"]["model.sparse_arch.embedding_bag_collection.groups.0.controllers.0"]
    assert truncated.shape[-1] == 2  # one slice of rank 3 was cut mid-run

    # sharded dense tables: put the shards together; every element held once, and trained
    covered: dict[str, int] = {}
    for r in ranks:
        for name, offsets, shard in r["shards"]:
            full = expected[name]
            rows, cols = shard.shape
            torch.testing.assert_close(
                shard,
                full[offsets[0] : offsets[0] + rows, offsets[1] : offsets[1] + cols],
                rtol=1e-5,
                atol=1e-6,
                msg=name,
            )
            covered[name] = covered.get(name, 0) + shard.numel()
    assert {n.rsplit(".", 2)[-2] for n in covered} == {"t_cat_2", "t_cat_3"}
    assert all(covered[n] == expected[n].numel() for n in covered)
    initial = worker.build_model().state_dict()
    assert all(not torch.equal(expected[n], initial[n]) for n in covered)  # the reference tables moved
    if sharding == "table_wise":  # each rank holds one table
        assert all(len(r["shards"]) == 1 for r in ranks)


DENSE_TABLES = {"t_cat_2", "t_cat_3"}  # the worker model's uncompressed tables
CPU = torch.device("cpu")


def test_cpu_tables_never_planned_data_parallel() -> None:
    got = dense_table_constraints(worker.build_model(), CPU)
    assert set(got) == DENSE_TABLES
    assert all(c.sharding_types == list(CPU_SHARDING_TYPES) for c in got.values())


def test_one_sharding_type_for_every_table() -> None:
    got = dense_table_constraints(worker.build_model(), CPU, sharding_type="column_wise")
    assert {n: c.sharding_types for n, c in got.items()} == {n: ["column_wise"] for n in DENSE_TABLES}


def test_table_constraint_overrides_and_keeps_its_other_fields() -> None:
    mine = ParameterConstraints(pooling_factors=[3.0])  # no sharding types: the CPU ones apply
    got = dense_table_constraints(worker.build_model(), CPU, sharding_type="table_wise", constraints={"t_cat_2": mine})
    assert got["t_cat_2"].pooling_factors == [3.0]
    assert got["t_cat_2"].sharding_types == list(CPU_SHARDING_TYPES)
    assert got["t_cat_3"].sharding_types == ["table_wise"]


@pytest.mark.parametrize("how", ["sharding_type", "constraints"])
def test_data_parallel_on_cpu_is_refused(how: str) -> None:
    kwargs = (
        {"sharding_type": "data_parallel"}
        if how == "sharding_type"
        else {"constraints": {"t_cat_3": ParameterConstraints(sharding_types=["data_parallel"])}}
    )
    with pytest.raises(ValueError, match="'t_cat_.': sharding type 'data_parallel' does not train on CPU"):
        dense_table_constraints(worker.build_model(), CPU, **kwargs)


def test_gpu_tables_left_to_the_planner() -> None:
    assert dense_table_constraints(worker.build_model(), torch.device("cuda")) == {}
    got = dense_table_constraints(worker.build_model(), torch.device("cuda"), sharding_type="data_parallel")
    assert all(c.sharding_types == ["data_parallel"] for c in got.values())


def test_planner_topology_has_this_hosts_memory(monkeypatch, caplog) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level("WARNING"):
        topology = planner_topology(4, CPU)
    assert not [r for r in caplog.records if "TopologyFactory" in r.getMessage()]
    assert topology.world_size == 4 and topology.compute_device == "cpu"
    assert all(d.storage.ddr == host_memory_bytes() // 2 for d in topology.devices)
    assert 0 < host_memory_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sequence_model():
    """The compressed sequential recommender of the pipelines tests, on ``meta``: a TTM item
    table and a dense ``genre`` table in a TorchRec ``EmbeddingCollection`` child."""
    from comera_rec import compress
    from tests.integration import pipelines_worker

    model = pipelines_worker.seq_model(torch.device("meta"))
    compress(model, pipelines_worker.POLICY)
    return model


def test_cpu_sequence_tables_never_planned_data_parallel() -> None:
    got = dense_table_constraints(sequence_model(), CPU)
    assert set(got) == {"genre"}
    assert got["genre"].sharding_types == list(CPU_SHARDING_TYPES)


def test_single_process_sequence_tables_get_the_embedding_optimizer_in_backward() -> None:
    from tests.integration import pipelines_worker

    spec = EmbeddingOptimizerSpec(RowWiseAdagrad, {"lr": 0.5, "eps": 1e-8})
    wrapped, fused = wrap_model(sequence_model(), device=CPU, embedding_optimizer=spec)
    assert not any(p.is_meta for p in wrapped.parameters())
    genre = wrapped.model.ec.dense.embeddings["genre"].weight
    assert [type(o) for o in genre._in_backward_optimizers] == [RowWiseAdagrad]
    groups = replicated_parameter_groups(wrapped)
    replicated = {id(p) for ps in groups.values() for p in ps}
    assert id(genre) not in replicated  # the table is the in-backward optimizer's alone
    assert groups["cores"] and all(id(p) in replicated for p in wrapped.model.ec.parameters() if p is not genre)
    optim = torch.optim.Adagrad([p for ps in groups.values() for p in ps], lr=pipelines_worker.LR)
    start = genre.detach().clone()
    losses = []
    for step in range(pipelines_worker.STEPS):
        loss, _ = wrapped(pipelines_worker.seq_batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-4:]) < sum(losses[:4]) - 0.2, losses
    moved = ((genre.detach() - start).abs().sum(1) > 0).nonzero().flatten().tolist()
    read = set()
    for step in range(pipelines_worker.DISTINCT):
        read |= set(pipelines_worker.seq_batch(step).sparse_features["genre"].values().tolist())
    assert moved == sorted(read)  # the rows the batches read, and only those
    assert genre.grad is None  # stepped in backward, not left for another optimiser
    # the returned optimiser holds the table's row-wise state, for checkpoints
    state = fused.state_dict()["state"]
    assert set(state) == {"model.ec.dense.embeddings.genre.weight"}
    torch.testing.assert_close(
        state["model.ec.dense.embeddings.genre.weight"]["sum"], genre._in_backward_optimizers[0].state[genre]["sum"]
    )
