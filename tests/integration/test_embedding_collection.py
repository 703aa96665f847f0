"""TTMEmbeddingCollection: TorchRec's EmbeddingCollection (unpooled) with TTM tables.

References are computed another way: TorchRec's own ``EmbeddingCollection`` loaded with
the dense reconstruction of every TTM table (values and the JaggedTensor layout), and
autograd through that reconstruction (gradients).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import comera_rec
from comera_rec.integration import CompressionPolicy, TableOverride, TTMEmbeddingBagCollection, compress
from comera_rec.integration.embedding_collection import TTMEmbeddingCollection, ttm_lookup_rows
from comera_rec.rank.budget import Cut, apply_cuts
from comera_rec.rank.size import model_num_parameters
from comera_rec.rank.truncation import truncate_model
from comera_rec.tensor import kernels
from comera_rec.tensor.stacked import StackedTTMTables
from comera_rec.tensor.train import tensor_train_modules
from tests.integration.helpers import STOCK_DMP_WARNINGS, run_two_process_worker

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [*STOCK_DMP_WARNINGS]
SHAPE = ((10, 10), (2, 4))  # rows <= 100, dim 8
BOUNDS = {"f0": 10, "f1": 100, "f2": 90, "f3": 300}


def ec_tables() -> list[EmbeddingConfig]:
    """Two stackable TTM tables (``a`` read by f0 and f1), a TTM table of another shape, and a
    small dense table that shares feature f0 with ``a`` (so f0 is ``f0@a`` and ``f0@c``)."""
    return [
        EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f0", "f1"]),
        EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=90, feature_names=["f2"]),
        EmbeddingConfig(name="c", embedding_dim=8, num_embeddings=10, feature_names=["f0"]),
        EmbeddingConfig(name="d", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
    ]


def ec_policy(rank: int = 4) -> CompressionPolicy:
    return CompressionPolicy(
        rank=rank,
        min_rows_to_compress=50,
        min_params_to_compress=0,
        min_gain=0.0,
        per_table={"a": TableOverride(shape=SHAPE), "b": TableOverride(shape=SHAPE)},
    )


def seq_kjt(batch: int = 3, seed: int = 0, bounds: dict[str, int] = BOUNDS) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (len(bounds), batch), generator=g)
    lengths[0, 0] = 0  # an empty sequence
    values = torch.cat(
        [torch.randint(0, n, (int(lengths[i].sum()),), generator=g) for i, n in enumerate(bounds.values())]
    )
    values[-1] = values[-2] if values.numel() > 1 else values[-1]  # a repeated id
    return KeyedJaggedTensor.from_lengths_sync(keys=list(bounds), values=values, lengths=lengths.reshape(-1))


def reference_ec(ttm: TTMEmbeddingCollection, need_indices: bool = False) -> EmbeddingCollection:
    """TorchRec's EmbeddingCollection loaded with the dense reconstruction of ``ttm``."""
    ref = EmbeddingCollection(ec_tables(), need_indices=need_indices)
    with torch.no_grad():
        for name, emb in ref.embeddings.items():
            emb.weight.copy_(ttm.table_weight(name))
    return ref


@pytest.fixture(params=["kernel", "torch"])
def lookup_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the fused CPU kernels, then with the PyTorch path."""
    if request.param == "torch":
        monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    else:
        monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
        if not kernels.cpu_kernel_enabled():
            pytest.skip("the fused CPU kernels are not built here")
    return request.param


# ---------------------------------------------------------------------------- the row lookup


@pytest.mark.parametrize("num_cores", [2, 3, 4])
@pytest.mark.parametrize("static", [False, True])
def test_rows_match_dense_reconstruction_float64(lookup_path: str, num_cores: int, static: bool) -> None:
    torch.manual_seed(num_cores)
    rows = {2: (8, 8), 3: (4, 4, 4), 4: (4, 4, 2, 2)}[num_cores]  # 64 rows
    cols = {2: (2, 4), 3: (2, 2, 2), 4: (2, 2, 2, 1)}[num_cores]  # padded dim 8
    tables = StackedTTMTables(
        [60, 45], 6, 3, row_shape=rows, col_shape=cols, dtype=torch.float64
    )  # dim 6 < padded 8, rows < prod(rows)
    with torch.no_grad():
        for d in tables.controllers:
            d.uniform_(0.5, 1.5)  # controllers take part in the gradient
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 45, (9,), generator=g).repeat(2)  # every (table, id) twice
    trains = torch.randint(0, 2, (9,), generator=g).repeat(2)
    out = ttm_lookup_rows(tables.scaled_cores(), tables.row_shape, 6, ids, trains, static_shapes=static)
    dense = [tables.dense_weight(t) for t in range(2)]
    want = torch.stack([dense[int(t)][int(i)] for i, t in zip(ids, trains)])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64)
    params = list(tables.parameters())
    got = torch.autograd.grad((out * weight).sum(), params)
    expected = torch.autograd.grad((want * weight).sum(), params)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_rows_of_no_ids_keep_the_graph(lookup_path: str) -> None:
    tables = StackedTTMTables([100], 8, 4, row_shape=SHAPE[0], col_shape=SHAPE[1])
    out = ttm_lookup_rows(tables.scaled_cores(), tables.row_shape, 8, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, 8)
    out.sum().backward()  # a batch without ids still backpropagates (zero gradients)
    assert all(float(p.grad.abs().sum()) == 0.0 for p in tables.parameters())


# The row lookup through the fused Triton kernels, run by Triton's interpreter in a child
# process (Triton reads TRITON_INTERPRET when it is imported): ids that claim to be on CUDA
# drive the dispatch on CPU tensors; the spy records how many ids reach the kernel.
_TRITON_ROWS = """
import json
import torch
from comera_rec.tensor import kernels
from comera_rec.tensor.stacked import StackedTTMTables
from comera_rec.integration.embedding_collection import ttm_lookup_rows

class FakeCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True

def plain(t):
    return t.as_subclass(torch.Tensor) if t is not None else None

calls = []
real = kernels.ttm_embedding_bag_triton
def spy(cores, row_shape, dim, ids, offsets, mode, weights, trains, **kw):
    calls.append(int(ids.numel()))
    return real(cores, row_shape, dim, plain(ids), plain(offsets), mode, weights, plain(trains), **kw)
kernels.ttm_embedding_bag_triton = spy
results = {}
for d, rows, cols in [(2, (8, 8), (2, 4)), (3, (4, 4, 4), (2, 2, 2))]:
    torch.manual_seed(d)
    tables = StackedTTMTables([60, 45], 6, 3, row_shape=rows, col_shape=cols, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 45, (9,), generator=g).repeat(2)
    trains = torch.randint(0, 2, (9,), generator=g).repeat(2)
    for static in (False, True):
        calls.clear()
        out = ttm_lookup_rows(
            tables.scaled_cores(), tables.row_shape, 6, ids.as_subclass(FakeCuda), trains, static_shapes=static
        ).as_subclass(torch.Tensor)
        want = torch.stack([tables.dense_weight(int(t))[int(i)] for i, t in zip(ids, trains)])
        w = torch.randn(out.shape, generator=g, dtype=torch.float64)
        got = torch.autograd.grad((out * w).sum(), list(tables.parameters()))
        expected = torch.autograd.grad((want * w).sum(), list(tables.parameters()))
        errs = [(out - want).abs().max().item()]
        errs += [(a.as_subclass(torch.Tensor) - b).abs().max().item() for a, b in zip(got, expected)]
        distinct = len(set(zip(ids.tolist(), trains.tolist())))
        results[f"d{d} static={static}"] = {"calls": calls[:], "err": max(errs), "distinct": distinct}
print(json.dumps(results))
"""


def test_rows_through_the_triton_kernels_in_the_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("COMERA_DISABLE_TRITON", kernels.DISABLE_ENV)}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_ROWS], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for case, r in results.items():
        # de-duplicated: each distinct (table, id) once; static shapes: every id
        assert r["calls"] == [18 if "static=True" in case else r["distinct"]], case
        assert r["distinct"] < 18
        assert r["err"] < 1e-12, case


# ---------------------------------------------------------------------------- the collection


@pytest.mark.parametrize("need_indices", [False, True])
def test_matches_torchrec_embedding_collection(lookup_path: str, need_indices: bool) -> None:
    torch.manual_seed(0)
    ttm = TTMEmbeddingCollection(ec_tables(), ec_policy(), need_indices=need_indices)
    assert ttm.compressed_tables() == ["a", "b", "d"] and ttm.dense_tables() == ["c"]
    assert len(ttm.groups) == 2  # a and b stacked, d alone
    ref = reference_ec(ttm, need_indices)
    assert ttm.embedding_names_by_table() == ref.embedding_names_by_table()
    assert ttm.embedding_dim() == 8 and ttm.need_indices() is need_indices
    for seed in range(3):
        features = seq_kjt(seed=seed)
        out, want = ttm(features), ref(features)
        assert list(out) == list(want) == ["f0@a", "f1", "f2", "f0@c", "f3"]
        for key, jt in want.items():
            got = out[key]
            assert isinstance(got, JaggedTensor)
            assert got.values().dtype == torch.float32 and got.values().shape == jt.values().shape
            torch.testing.assert_close(got.values(), jt.values(), rtol=1e-5, atol=1e-6, msg=key)
            assert torch.equal(got.lengths(), jt.lengths()), key
            assert torch.equal(got.offsets(), jt.offsets()), key
            if need_indices:
                assert torch.equal(got.weights(), jt.weights()), key
            else:
                assert got.weights_or_none() is None


@pytest.mark.parametrize("min_rows", [0, 10**9])
def test_all_tables_compressed_or_all_dense(min_rows: int) -> None:
    torch.manual_seed(6)
    policy = CompressionPolicy(rank=4, min_rows_to_compress=min_rows, min_params_to_compress=0, min_gain=0.0)
    ttm = TTMEmbeddingCollection(ec_tables(), policy, need_indices=True)
    assert (ttm.dense is None) == (min_rows == 0) and (len(ttm.groups) == 0) == (min_rows > 0)
    features = seq_kjt(seed=4)
    out, want = ttm(features), reference_ec(ttm, need_indices=True)(features)
    assert list(out) == list(want)
    for key, jt in want.items():
        torch.testing.assert_close(out[key].values(), jt.values(), rtol=1e-5, atol=1e-6, msg=key)
        assert torch.equal(out[key].lengths(), jt.lengths()) and torch.equal(out[key].weights(), jt.weights())


def test_meta_build_then_to_empty_and_reset_parameters() -> None:
    ttm = TTMEmbeddingCollection(ec_tables(), ec_policy(), device="meta")
    ttm.to_empty(device="cpu")
    ttm.reset_parameters()
    for name, p in ttm.named_parameters():
        assert torch.isfinite(p).all() and float(p.detach().abs().max()) < 10.0, name
    dense = ttm.table_weight("c")  # TorchRec's uniform init in [-1/sqrt(rows), 1/sqrt(rows)]
    assert float(dense.detach().abs().max()) <= 10**-0.5 and float(dense.detach().std()) > 0.01
    out = ttm(seq_kjt())
    assert all(torch.isfinite(jt.values()).all() for jt in out.values())


def test_gradients_match_autograd_of_the_dense_reconstruction(lookup_path: str) -> None:
    torch.manual_seed(1)
    ttm = TTMEmbeddingCollection(ec_tables(), ec_policy())
    with torch.no_grad():
        for group in ttm.groups:
            for d in group.controllers:
                d.uniform_(0.5, 1.5)
    features = seq_kjt(batch=4, seed=3)
    out = ttm(features)
    g = torch.Generator().manual_seed(2)
    probes = {k: torch.randn(jt.values().shape, generator=g) for k, jt in out.items()}
    loss = sum((jt.values() * probes[k]).sum() for k, jt in out.items())
    params = [p for _, p in ttm.named_parameters()]
    got = torch.autograd.grad(loss, params)

    # the same loss through each table's whole reconstruction, differentiable in the cores
    jts = features.to_dict()
    reference = 0.0
    for table, names in zip(ec_tables(), ttm.embedding_names_by_table()):
        weight = ttm.table_weight(table.name)
        for name, feature in zip(names, table.feature_names):
            reference = reference + (weight[jts[feature].values()] * probes[name]).sum()
    expected = torch.autograd.grad(reference, params)
    for (name, _), a, b in zip(ttm.named_parameters(), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_bad_inputs_name_what_was_wrong(lookup_path: str) -> None:
    ttm = TTMEmbeddingCollection(ec_tables(), ec_policy())
    good = seq_kjt()
    values = good.values().clone()
    f3_start = good.offset_per_key()[3]
    values[f3_start] = 300
    bad = KeyedJaggedTensor.from_lengths_sync(keys=good.keys(), values=values, lengths=good.lengths())
    with pytest.raises(ValueError, match=r"feature 'f3' has id 300 out of range \[0, 300\) of table 'd'"):
        ttm(bad)
    values = good.values().clone()
    values[0] = -1  # f0's first id: read by a (100 rows) and c (10): the smaller bound names c
    bad = KeyedJaggedTensor.from_lengths_sync(keys=good.keys(), values=values, lengths=good.lengths())
    with pytest.raises(ValueError, match=r"feature 'f0' has id -1 out of range \[0, 10\) of table 'c'"):
        ttm(bad)
    missing = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"lacks feature\(s\) \['f1', 'f2', 'f3'\]"):
        ttm(missing)
    extra = KeyedJaggedTensor.from_lengths_sync(
        keys=[*good.keys(), "zz"], values=good.values(), lengths=torch.cat([good.lengths(), torch.zeros(3).long()])
    )
    with pytest.raises(ValueError, match=r"key\(s\) \['zz'\] are in no table config"):
        ttm(extra)
    relaxed = TTMEmbeddingCollection(ec_tables(), ec_policy(), allow_extra_keys=True)
    assert "zz" not in relaxed(extra)
    with pytest.raises(TypeError, match="expected a KeyedJaggedTensor"):
        ttm(good.values())
    lengths = good.lengths().clone()
    lengths[5] = -1  # f1, sample 2
    with pytest.raises(ValueError, match="negative length -1 at feature 'f1', sample 2"):
        ttm(KeyedJaggedTensor(keys=good.keys(), values=good.values(), lengths=lengths))
    with pytest.raises(ValueError, match=f"lengths sum to {good.values().numel()} but it holds"):
        ttm(KeyedJaggedTensor(keys=good.keys(), values=good.values()[1:], lengths=good.lengths()))
    with pytest.raises(TypeError, match="values .ids. must be an integer tensor"):
        ttm(KeyedJaggedTensor(keys=good.keys(), values=good.values().float(), lengths=good.lengths()))


def test_unsupported_configs_are_refused() -> None:
    with pytest.raises(TypeError, match="EmbeddingBagConfig .pooled.; use EmbeddingConfig"):
        TTMEmbeddingCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100)], ec_policy())
    mixed = ec_tables()
    mixed[1] = EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=90, feature_names=["f2"])
    with pytest.raises(ValueError, match="one embedding_dim"):
        TTMEmbeddingCollection(mixed, ec_policy())
    half = [EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=100, data_type=DataType.FP16)]
    with pytest.raises(ValueError, match="compressed table 'a' must be FP32"):
        TTMEmbeddingCollection(half, ec_policy())
    with pytest.raises(ValueError, match=r"duplicate table names \['a'\]"):
        TTMEmbeddingCollection([ec_tables()[0], ec_tables()[0]], ec_policy())
    with pytest.raises(ValueError, match="at least one table"):
        TTMEmbeddingCollection([], ec_policy())


def test_from_embedding_collection_is_exact_at_full_rank() -> None:
    torch.manual_seed(2)
    ec = EmbeddingCollection(ec_tables(), need_indices=True)
    ttm = TTMEmbeddingCollection.from_embedding_collection(ec, ec_policy(rank=100))
    assert ttm.compressed_tables() == ["a", "b", "d"] and ttm.need_indices()
    features = seq_kjt(seed=5)
    out, want = ttm(features), ec(features)
    assert list(out) == list(want)
    for key, jt in want.items():
        torch.testing.assert_close(out[key].values(), jt.values(), rtol=1e-4, atol=1e-5, msg=key)
        assert torch.equal(out[key].weights(), jt.weights())
    assert ttm.dense.embeddings["c"].weight.data_ptr() != ec.embeddings["c"].weight.data_ptr()
    torch.testing.assert_close(ttm.table_weight("c"), ec.embeddings["c"].weight)


def test_lazy_export() -> None:
    assert comera_rec.TTMEmbeddingCollection is TTMEmbeddingCollection


# ---------------------------------------------------------------------------- compress and truncation


class _TwoKinds(nn.Module):
    """A pooled and a sequence collection side by side (a two-tower / BERT4Rec-like holder)."""

    def __init__(self) -> None:
        super().__init__()
        self.pooled = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
                EmbeddingBagConfig(name="v", embedding_dim=8, num_embeddings=10, feature_names=["f0"]),
            ]
        )
        self.sequence = EmbeddingCollection(ec_tables())

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        seq = self.sequence(features)
        return torch.cat([self.pooled(features).values().sum(1)] + [jt.values().sum(1) for jt in seq.values()])


def test_compress_converts_both_collection_kinds_and_reports_them() -> None:
    torch.manual_seed(3)
    model = _TwoKinds()
    features = seq_kjt(seed=6)
    before = model(features)
    report = compress(model, ec_policy(rank=100))  # full rank: TT-SVD reproduces the trained tables
    assert isinstance(model.pooled, TTMEmbeddingBagCollection)
    assert isinstance(model.sequence, TTMEmbeddingCollection)
    assert model.sequence.compressed_tables() == ["a", "b", "d"]
    by_name = {m.name: m for m in report.modules}
    assert by_name["sequence"].kind == "TTMEmbeddingCollection"
    assert by_name["sequence"].params_before == (100 + 90 + 10 + 300) * 8
    assert by_name["sequence"].params_after == sum(p.numel() for p in model.sequence.parameters())
    kept = {k.name: k for k in report.kept}
    assert kept["sequence.c"].kind == "table" and kept["sequence.c"].params == 80
    assert "min_rows_to_compress=50" in kept["sequence.c"].reason
    assert "pooled.v" in kept and "sequence" not in kept
    torch.testing.assert_close(model(features), before, rtol=1e-4, atol=1e-5)
    assert "sequence" in str(report)

    # compressing again leaves the sequence collection's dense child alone
    again = compress(model, ec_policy(rank=100))
    assert not any(m.name.startswith("sequence") for m in again.modules)
    assert type(model.sequence.dense) is EmbeddingCollection


def test_compress_of_a_subclass_says_why_it_is_kept() -> None:
    class Custom(EmbeddingCollection):
        pass

    holder = nn.Module()
    holder.seq = Custom(ec_tables())
    report = compress(holder, ec_policy())
    assert "a subclass (Custom) of EmbeddingCollection" in {k.name: k for k in report.kept}["seq"].reason
    with pytest.raises(TypeError, match="pass the model that holds the module"):
        compress(EmbeddingCollection(ec_tables()), ec_policy())


def test_truncation_shrinks_the_sequence_tables_and_keeps_their_outputs() -> None:
    torch.manual_seed(4)
    model = _TwoKinds()
    compress(model, ec_policy(rank=4))
    names = dict(tensor_train_modules(model))
    assert {"sequence.groups.0", "sequence.groups.1", "pooled.groups.0"} <= set(names)
    stacked = names["sequence.groups.0"]  # tables a and b
    assert stacked.ranks == [4]
    params_before = model_num_parameters(model)
    # the cut the rank schedule makes: a slice's controllers set to 0 in every stacked table
    apply_cuts(model, [Cut("sequence.groups.0", 0, 1, 0.0, 0), Cut("sequence.groups.0", 0, 3, 0.0, 0)])
    features = seq_kjt(seed=7)
    expected = {k: jt.values().detach() for k, jt in model.sequence(features).items()}
    result = truncate_model(model, threshold=1e-6)
    assert result.changed
    assert result.ranks_before["sequence.groups.0"] == [4] and result.ranks_after["sequence.groups.0"] == [2]
    assert model.sequence.groups[0].cores[0].shape[-1] == 2 and model.sequence.groups[0].cores[1].shape[1] == 2
    assert model_num_parameters(model) < params_before
    out = model.sequence(features)
    for key, values in expected.items():
        torch.testing.assert_close(out[key].values(), values, rtol=1e-5, atol=1e-6, msg=key)
    reference = reference_ec(model.sequence)
    for key, jt in reference(features).items():  # still TorchRec's EmbeddingCollection on the cut tables
        torch.testing.assert_close(out[key].values(), jt.values(), rtol=1e-5, atol=1e-6, msg=key)
    out["f1"].values().sum().backward()  # the new, smaller parameters train
    assert model.sequence.groups[0].cores[0].grad is not None


# ---------------------------------------------------------------------------- meta device and DMP


class _Tower(nn.Module):
    def __init__(self, device: str, build: str = "direct") -> None:
        super().__init__()
        if build == "direct":
            self.ec = TTMEmbeddingCollection(ec_tables(), ec_policy(), device=device)
        else:  # TorchRec's collection on meta, then compress() (no weights: the fresh TT init)
            self.ec = EmbeddingCollection(ec_tables(), device=torch.device(device))
            compress(self, ec_policy())
        self.head = nn.Linear(8, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return torch.cat([self.head(jt.values()).flatten() for jt in self.ec(features).values()]).square().mean()


@pytest.mark.parametrize("build", ["direct", "compress"])
def test_meta_collection_initialises_and_trains_under_stock_dmp(gloo, build: str) -> None:
    torch.manual_seed(5)
    model = _Tower("meta", build)
    assert isinstance(model.ec, TTMEmbeddingCollection) and model.ec.compressed_tables() == ["a", "b", "d"]
    assert all(p.is_meta for p in model.ec.parameters())
    wrapped = DistributedModelParallel(
        module=model, device=torch.device("cpu"), sharders=[EmbeddingCollectionSharder()]
    )
    assert model.ec.device == torch.device("cpu")
    for name, p in wrapped.named_parameters():
        assert not p.is_meta and bool(torch.isfinite(p).all()), name
        assert float(p.detach().abs().max()) < 10.0, name
    for group in model.ec.groups:  # the TT init of a CPU build: controllers 1, tables of the documented scale
        assert all(torch.equal(d, torch.ones_like(d)) for d in group.controllers)
    for name, rows in (("a", 100), ("d", 300)):
        std = float(model.ec.table_weight(name).detach().std())
        assert 0.3 / (3 * rows) ** 0.5 < std < 3 / (3 * rows) ** 0.5, name
    features = seq_kjt(batch=4, seed=8)
    out = model.ec(features)
    assert list(out) == ["f0@a", "f1", "f2", "f0@c", "f3"]
    assert all(torch.equal(out[k].lengths(), features[k.split("@")[0]].lengths()) for k in out)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    start = [p.detach().clone() for p in model.ec.groups.parameters()]
    losses = []
    for _ in range(5):
        loss = wrapped(features)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] and all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(a, b) for a, b in zip(start, model.ec.groups.parameters()))


def test_two_process_dmp_matches_one_process(tmp_path: Path) -> None:
    out = run_two_process_worker("ec_dmp_worker.py", tmp_path, timeout=280)
    from tests.integration import ec_dmp_worker as worker

    expected = worker.train_one_process()
    initial = worker.build().state_dict()
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    # replicated (TT cores, controllers, head): equal on both ranks and to one process on the global batch
    assert any(".groups." in n for n in ranks[0]["replicated"])
    for name, value in ranks[0]["replicated"].items():
        torch.testing.assert_close(ranks[1]["replicated"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(value, initial[name]), f"{name} did not train"
    # the dense table, sharded table-wise: held whole by one rank, trained like the reference
    shards = [s for r in ranks for s in r["shards"]]
    assert [(name, offsets) for name, offsets, _ in shards] == [
        (f"ec.dense.embeddings.{worker.DENSE_TABLE}.weight", [0, 0])
    ]
    name, _, shard = shards[0]
    torch.testing.assert_close(shard, expected[name], rtol=1e-5, atol=1e-6)
    assert not torch.equal(shard, initial[name])


@pytest.mark.parametrize("need_indices", [False, True])
def test_decompress_gives_torchrec_collection_with_the_same_outputs(need_indices: bool) -> None:
    """decompress() turns the collection (after a rank cut) back into TorchRec's own
    EmbeddingCollection: the same sequences, and a state dict a stock collection loads."""
    from comera_rec.integration import decompress

    torch.manual_seed(0)
    model = nn.ModuleDict({"ec": TTMEmbeddingCollection(ec_tables(), ec_policy(), need_indices=need_indices)})
    group = next(m for _, m in tensor_train_modules(model))
    with torch.no_grad():
        group.controllers[0][..., 1:] = 0.0
    assert truncate_model(model, 1e-3).changed
    kjt = seq_kjt()
    with torch.no_grad():
        before = model["ec"](kjt)
        report = decompress(model)
        after = model["ec"](kjt)
    assert type(model["ec"]) is EmbeddingCollection and [m.kind for m in report.modules] == ["EmbeddingCollection"]
    assert report.params_after > report.params_before
    assert set(after) == set(before)
    for key, jt in before.items():
        torch.testing.assert_close(after[key].values(), jt.values(), rtol=1e-5, atol=1e-6)
        assert torch.equal(after[key].lengths(), jt.lengths())
        if need_indices:
            assert torch.equal(after[key].weights(), jt.weights())
    stock = EmbeddingCollection(ec_tables(), need_indices=need_indices)
    stock.load_state_dict(model["ec"].state_dict())  # strict: same keys and shapes


def test_collection_trained_under_stock_dmp_decompresses_from_its_dcp_checkpoint(gloo, tmp_path: Path) -> None:
    """The way a TorchRec user gets there: train under DistributedModelParallel in their own
    loop, save ``wrapped.state_dict()`` with ``torch.distributed.checkpoint``, read it back whole
    into the model built without DMP, and decompress: the stock collection then gives the
    sequences the trained, sharded one gave."""
    import torch.distributed.checkpoint as dcp

    from comera_rec.integration import decompress
    from comera_rec.training.dcp_io import load_whole

    torch.manual_seed(5)
    model = _Tower("meta")
    wrapped = DistributedModelParallel(
        module=model, device=torch.device("cpu"), sharders=[EmbeddingCollectionSharder()]
    )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    features = seq_kjt(batch=4, seed=8)
    with torch.no_grad():
        initial = {k: jt.values().clone() for k, jt in model.ec(features).items()}
    for _ in range(3):
        wrapped(features).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = {k: jt.values().clone() for k, jt in model.ec(features).items()}
    dcp.save(wrapped.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))

    state = load_whole(tmp_path / "ckpt")  # sharded tables come back whole, plain tensors
    fresh = _Tower("cpu")
    fresh.load_state_dict(state)  # strict: every key of the DMP state dict is the plain model's
    report = decompress(fresh)
    assert type(fresh.ec) is EmbeddingCollection and [m.kind for m in report.modules] == ["EmbeddingCollection"]
    with torch.no_grad():
        out = fresh.ec(features)
    assert set(out) == set(trained)
    for key, values in trained.items():
        torch.testing.assert_close(out[key].values(), values, rtol=1e-5, atol=1e-6, msg=key)
    assert all(not torch.equal(trained[k], initial[k]) for k in ("f0@a", "f0@c", "f3"))  # TT and dense tables trained
