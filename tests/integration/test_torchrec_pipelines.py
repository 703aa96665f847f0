"""TorchRec training pipelines, stock and with ``comera_rec.compress`` added (issue 26).

Four styles as TorchRec's examples write them (``tests/integration/pipelines_worker.py``):

* DLRM-DCN: ``DLRM_DCN`` in ``DLRMTrain``, tables on ``meta``, ``RowWiseAdagrad`` applied
  in backward, stock DMP, ``KeyedOptimizerWrapper`` + ``CombinedOptimizer``;
* a two-tower retrieval model (query and candidate ``EmbeddingBagCollection`` + MLP,
  dot-product logits, BCE), stock DMP, the sharder's fused SGD;
* ``TrainPipelineSparseDist`` on the compressed DLRM-DCN with a ``RankAdapter``;
* a sequential recommender (an ``EmbeddingCollection`` of a history, a target item and
  its genre), stock DMP with ``EmbeddingCollectionSharder``, trained by
  ``TrainPipelineSparseDist`` as TorchRec's BERT4Rec example does; compressed, also
  through ``wrap_model`` and with a ``RankAdapter``.

Each stock model and its compressed version (one added line) trains: finite, falling
loss, every TT parameter, every other replicated parameter and every dense table moved.
Under ``torchrun`` with two processes, each on its half of the global batch, the
replicated parameters are bit-equal on both ranks and equal to one process on the whole
batch (1e-4: float32 noise grown by Adagrad, see ``TOL``), and the table shards put together are the one-process tables.

CPU only: the dense tables are planned ``table_wise`` (TorchRec's planner would put the
small ones on ``data_parallel``, whose FBGEMM CPU lookup has no autograd kernel, so they
would not train; docs/torchrec.md). One torchrun launch runs every style.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.distributed as dist

import comera_rec
from comera_rec.integration import destroy_distributed
from comera_rec.tensor import kernels
from tests.integration import pipelines_worker as worker
from tests.integration.helpers import STOCK_DMP_WARNINGS, run_two_process_worker

pytestmark = [
    *STOCK_DMP_WARNINGS,
    pytest.mark.filterwarnings("ignore:This API is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*does not apply to TT parameters:UserWarning"),
    pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning"),  # DMP's ShardedTensor state
]

TRAINING = [
    "dcn_stock",
    "dcn_compressed",
    "tower_stock",
    "tower_compressed",
    "seq_stock",
    "seq_compressed",
    "seq_wrapped",
]
# Two ranks sum their halves of the batch in another order than one process, and DDP
# averages: float32 noise (1e-7 on the loss) that 16 Adagrad steps through the TT products
# grow to ~3e-5 on a few core entries (the stock models: ~1e-6). A real difference (a
# gradient not averaged, or averaged twice) moves parameters by the learning rate, 5e-2.
TOL = {"rtol": 1e-4, "atol": 1e-4}
DENSE_TABLES = {  # the tables TorchRec shards (all of them in the stock models)
    "dcn_stock": {"t0", "t1", "t2", "t3"},
    "dcn_compressed": {"t2", "t3"},
    "tower_stock": {"user", "query_ctx", "item", "item_cat"},
    "tower_compressed": {"query_ctx", "item_cat"},
    "pipeline_adapter": {"t2", "t3"},
    "tower_adapter": {"query_ctx", "item_cat"},
    "seq_stock": {"item", "genre"},
    "seq_compressed": {"genre"},
    "seq_wrapped": {"genre"},
    "seq_adapter": {"genre"},
}
# the compressed collections each adapter style must have cut below the policy's rank
ADAPTED_COLLECTIONS = {
    "pipeline_adapter": ["model.sparse_arch.embedding_bag_collection.groups.0"],
    "tower_adapter": ["two_tower.query_tower.ebc.groups.0", "two_tower.candidate_tower.ebc.groups.0"],
    "seq_adapter": ["model.ec.groups.0"],  # the sequence collection's TTM item table
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Callable[[str], dict]:
    """``get(style)``: the style trained by one process on the global batches (run once)."""
    results: dict[str, dict] = {}

    def get(style: str) -> dict:
        if style not in results:
            store = tmp_path_factory.mktemp("pg") / "store"
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
            try:
                results[style] = worker.run(style, rank=0, world=1)
            finally:
                destroy_distributed()
        return results[style]

    return get


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Callable[[str], list[dict]]:
    """``get(style)``: both ranks' results of one torchrun launch that runs every style."""
    tmp = tmp_path_factory.mktemp("torchrun")
    out = run_two_process_worker("pipelines_worker.py", tmp, timeout=400)
    return lambda style: [torch.load(out / f"{style}.rank{r}.pt") for r in range(2)]


def table_name(state_name: str) -> str:
    return state_name.rsplit(".", 2)[-2]  # "...embedding_bags.<table>.weight"


def check_trains(result: dict, style: str) -> None:
    """Finite, falling loss; every replicated parameter (TT ones included) and every local
    table shard moved; TT modules exactly in the compressed styles."""
    losses = result["losses"]
    assert result["finite"], losses
    first, last = losses[: worker.DISTINCT], losses[-worker.DISTINCT :]  # each batch once
    assert sum(last) / len(last) < sum(first) / len(first) - 0.05, losses
    assert result["unchanged"] == [], result["unchanged"]
    assert result["unchanged_shards"] == [], result["unchanged_shards"]
    assert bool(result["tt"]) == (not style.endswith("_stock"))
    assert not result["tt"] or any("groups" in n for n in result["tt"])  # the tables themselves


@pytest.mark.parametrize("style", TRAINING)
def test_one_process_trains(one_process, style: str) -> None:
    result = one_process(style)
    check_trains(result, style)
    assert {table_name(n) for n in result["tables"]} == DENSE_TABLES[style]


@pytest.mark.slow
@pytest.mark.parametrize("style", ["seq_stock", "seq_compressed", "seq_wrapped"])
def test_sequence_model_lookups_run_in_the_pipeline(one_process, two_processes, style: str) -> None:
    # the sharded tables' lookups are the pipeline's (a stock table, or the compressed
    # collection's dense child: its input is the batch's KJT itself)
    assert one_process(style)["pipelined"]
    assert all(r["pipelined"] for r in two_processes(style))


def test_wrap_model_trains_sequence_tables_with_the_embedding_optimizer(one_process) -> None:
    # wrap_model applies the embedding optimizer (SGD, lr TOWER_LR) to the EmbeddingCollection's
    # table before DMP, as the stock style's sharder is given it: the same run. (Before, the
    # sequence tables got the sharder's default optimizer and the given one was ignored.)
    wrapped, stock = one_process("seq_wrapped"), one_process("seq_compressed")
    torch.testing.assert_close(torch.tensor(wrapped["losses"]), torch.tensor(stock["losses"]), rtol=1e-6, atol=1e-7)
    for (name, offsets, shard), (name_s, offsets_s, shard_s) in zip(wrapped["shards"], stock["shards"]):
        assert (name, offsets) == (name_s, offsets_s)
        torch.testing.assert_close(shard, shard_s, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("style", TRAINING)
def test_two_processes_match_one_process(one_process, two_processes, style: str) -> None:
    ranks, expected = two_processes(style), one_process(style)
    for r in ranks:
        check_trains(r, style)
    # replicated (TT cores, controllers, MLPs, cross net): the same on both ranks, and
    # those of one process on the global batch
    assert ranks[0]["replicated"].keys() == ranks[1]["replicated"].keys() == expected["replicated"].keys()
    for name, value in ranks[0]["replicated"].items():
        torch.testing.assert_close(ranks[1]["replicated"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(value, expected["replicated"][name], **TOL, msg=name)
    # sharded tables: each rank's shards are slices of the one-process tables, every element
    # held once; table-wise on two ranks, both ranks hold some
    full = {name: shard for name, _, shard in expected["shards"]}  # one process: whole tables
    covered: dict[str, int] = {}
    for r in ranks:
        for name, (r0, c0), shard in r["shards"]:
            rows, cols = shard.shape
            torch.testing.assert_close(shard, full[name][r0 : r0 + rows, c0 : c0 + cols], **TOL, msg=name)
            covered[name] = covered.get(name, 0) + shard.numel()
    assert {table_name(n) for n in covered} == DENSE_TABLES[style]
    assert all(covered[n] == full[n].numel() for n in covered)
    if len(DENSE_TABLES[style]) > 1:  # (one table, table-wise: one rank holds it)
        assert all(r["shards"] for r in ranks)
    # the losses are of each half; their mean is the one-process loss of the global batch
    torch.testing.assert_close(
        (torch.tensor(ranks[0]["losses"]) + torch.tensor(ranks[1]["losses"])) / 2,
        torch.tensor(expected["losses"]),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("kind", ["dcn", "tower"])
def test_compressed_models_get_gradients_laid_out_as_their_parameters(kind: str, kernel: bool) -> None:
    # DMP's DDP copies each gradient into a bucket view with its parameter's strides and warns
    # when they differ: TT layers converted by SVD had column-major cores, and a table stacked
    # alone a (1, r) middle controller gradient with the padded rank's stride
    model = worker.dcn_model(worker.CPU) if kind == "dcn" else worker.tower_model(worker.CPU)
    comera_rec.compress(model, worker.POLICY)
    kernels.set_cpu_kernel_enabled(kernel)
    try:
        loss = model(worker.dcn_batch(0))[0] if kind == "dcn" else model(*worker.tower_batch(0))[0]
        loss.backward()
    finally:
        kernels.set_cpu_kernel_enabled(True)
    tt = set(worker.tt_names(model))
    params = dict(model.named_parameters())
    assert tt <= params.keys() and len(tt) > 10
    for name, p in params.items():
        assert p.grad is not None, name
        assert p.stride() == torch.empty(p.shape).stride(), (name, p.stride())
        assert p.grad.stride() == p.stride(), (name, p.grad.stride(), p.stride())


@pytest.mark.slow
def test_no_style_makes_ddp_warn_of_gradient_layouts(two_processes) -> None:
    for style in worker.STYLES:
        for r in two_processes(style):
            assert r["layout_warnings"] == [], (style, r["layout_warnings"])


# ---------------------------------------------------------------------------- pipeline + RankAdapter


def check_adapted(result: dict, style: str) -> None:
    """Cuts in several events down to the target; training goes on after each."""
    sizes, numels, losses = result["sizes"], result["numels"], result["losses"]
    assert result["finite"], losses  # after every cut too
    assert numels[-1] < result["start_numel"] / 2 and sizes[-1] < result["start_bytes"] / 2
    assert all(b <= a for a, b in zip(numels, numels[1:])), numels
    events = sum(result["rebuilt"])  # DMP's DDP rebuilt exactly at the cut events
    assert events >= 3 and events == sum(1 for a, b in zip([result["start_numel"], *numels], numels) if b < a)
    assert abs(sizes[-1] - result["target_bytes"]) <= 0.1 * result["target_bytes"]
    for collection in ADAPTED_COLLECTIONS[style]:
        assert max(result["ranks"][collection]) < worker.POLICY.rank, (collection, result["ranks"])
    assert result["stale_ddp"] == [] and result["missing_from_optimizer"] == []
    last_cut = max(i for i, r in enumerate(result["rebuilt"]) if r)
    assert last_cut < len(losses) - 5  # steps after the last cut
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.1, losses
    assert result["unchanged"] == [] and result["unchanged_shards"] == []
    assert {table_name(n) for n in result["tables"]} <= DENSE_TABLES[style]


@pytest.mark.parametrize("compressed", [False, True])
def test_dcn_trains_with_its_forward_under_autocast(tmp_path, compressed: bool) -> None:
    # a user's mixed-precision loop on the stock pipeline (meta tables, DMP, RowWiseAdagrad in
    # backward, KeyedOptimizerWrapper): the compressed model trains as the stock one does
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        result = worker.run_dcn(0, 1, compressed, autocast=True)
    finally:
        destroy_distributed()
    check_trains(result, "dcn_compressed" if compressed else "dcn_stock")


def test_sparse_dist_pipeline_with_rank_adapter(one_process) -> None:
    result = one_process("pipeline_adapter")
    check_adapted(result, "pipeline_adapter")
    assert {table_name(n) for n in result["tables"]} == DENSE_TABLES["pipeline_adapter"]
    assert result["pipelined"] and result["exhausted"]  # the dense tables' input dist still pipelined


def test_two_tower_loop_with_rank_adapter(one_process) -> None:
    # one ranking over both towers' collections and MLPs: each tower's table is cut
    result = one_process("tower_adapter")
    check_adapted(result, "tower_adapter")
    assert {table_name(n) for n in result["tables"]} == DENSE_TABLES["tower_adapter"]


def test_sequence_pipeline_with_rank_adapter(one_process) -> None:
    # the EmbeddingCollection's TTM table ranked and cut with the MLP, through the pipeline
    result = one_process("seq_adapter")
    check_adapted(result, "seq_adapter")
    assert {table_name(n) for n in result["tables"]} == DENSE_TABLES["seq_adapter"]
    assert result["pipelined"]


@pytest.mark.slow
@pytest.mark.parametrize("style", ["pipeline_adapter", "tower_adapter", "seq_adapter"])
def test_rank_adapter_two_processes(two_processes, style: str) -> None:
    ranks = two_processes(style)
    for r in ranks:
        check_adapted(r, style)
    # every process cut the same slices at the same steps, and stayed in sync
    assert ranks[0]["ranks"] == ranks[1]["ranks"] and ranks[0]["sizes"] == ranks[1]["sizes"]
    assert ranks[0]["rebuilt"] == ranks[1]["rebuilt"]
    assert ranks[0]["replicated"].keys() == ranks[1]["replicated"].keys()
    for name, value in ranks[0]["replicated"].items():
        torch.testing.assert_close(ranks[1]["replicated"][name], value, rtol=0, atol=0, msg=name)
    held = [{table_name(n) for n in r["tables"]} for r in ranks]
    assert held[0] | held[1] == DENSE_TABLES[style] and not held[0] & held[1]
    assert all(math.isfinite(v) for r in ranks for v in r["losses"])


def test_variable_batch_sizes_are_refused_with_sharded_dense_tables(tmp_path) -> None:
    # the sharded dense child's input distribution takes the batch's KJT as it is: a VBE
    # batch is refused by name, not looked up wrongly
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = worker.build_dcn(1, compressed=True)
        keys = [f"f{i}" for i in range(len(worker.DCN_SIZES))]
        features = KeyedJaggedTensor(
            keys=keys,
            values=torch.tensor([1, 2, 3, 4, 5]),
            lengths=torch.ones(5, dtype=torch.long),
            stride_per_key_per_rank=[[2], [1], [1], [1]],
            inverse_indices=(keys, torch.tensor([[0, 1], [0, 0], [0, 0], [0, 0]])),
        )
        batch = worker.dcn_batch(0, 0, 2)
        with pytest.raises(ValueError, match="VBE. with sharded dense tables are not supported"):
            model(type(batch)(dense_features=batch.dense_features, sparse_features=features, labels=batch.labels))
    finally:
        destroy_distributed()
