"""TTMEmbeddingBagCollection against TorchRec's EmbeddingBagCollection."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import comera_rec.tensor.stacked as stacked
from comera_rec.integration import CompressionPolicy, TTMEmbeddingBagCollection
from comera_rec.integration.collection_layout import one_batch_size
from comera_rec.tensor import cached_weights
from comera_rec.tensor.derived import derived_cache
from comera_rec.tensor.stacked import StackedTTMTables
from tests.integration.helpers import kjt, policy, reference_ebc, tables


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_matches_torchrec_ebc(pooling: PoolingType, lookup_path: str) -> None:
    configs = tables(pooling)
    ttm = TTMEmbeddingBagCollection(configs, policy())
    assert ttm.compressed_tables() == ["a", "b", "d"] and ttm.dense_tables() == ["c"]
    assert len(ttm.groups) == 2  # a and b stacked, d alone
    ref = reference_ebc(ttm, tables(pooling))
    features = kjt()
    out, expected = ttm(features), ref(features)
    assert out.keys() == expected.keys() == ["f0@a", "f1", "f2", "f0@c", "f3"]
    assert out.length_per_key() == expected.length_per_key()
    torch.testing.assert_close(out.values(), expected.values(), rtol=1e-5, atol=1e-6)


def test_weighted_matches_torchrec_ebc(lookup_path: str) -> None:
    configs = [t for t in tables() if t.name != "b"]  # TorchRec's weighted bags are SUM only
    ttm = TTMEmbeddingBagCollection(configs, policy(), is_weighted=True, allow_extra_keys=True)
    assert ttm.is_weighted()
    ref = reference_ebc(ttm, [t for t in tables() if t.name != "b"], weighted=True)
    features = kjt(weighted=True)
    torch.testing.assert_close(ttm(features).values(), ref(features).values(), rtol=1e-5, atol=1e-6)
    unweighted = TTMEmbeddingBagCollection(configs, policy(), allow_extra_keys=True)
    unweighted.load_state_dict(ttm.state_dict())
    assert not torch.allclose(unweighted(features).values(), ttm(features).values())


def test_gradients_match_torchrec_ebc(lookup_path: str) -> None:
    check_gradients_against_torchrec(kjt(), batch=3)


def check_gradients_against_torchrec(features: KeyedJaggedTensor, batch: int) -> None:
    """The cores', controllers' and dense table's gradients of the collection on ``features``
    against TorchRec's EBC on the tables' dense reconstruction."""
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    ref = EmbeddingBagCollection(tables())
    # the reference table is the differentiable reconstruction of the cores
    grad_out = torch.randn(batch, 40)
    (ttm(features).values() * grad_out).sum().backward()
    for name in ("a", "b", "d"):
        ref.embedding_bags[name].weight.data = ttm.table_weight(name).detach().clone()
    ref.embedding_bags["c"].weight.data = ttm.dense.embedding_bags["c"].weight.detach().clone()
    (ref(features).values() * grad_out).sum().backward()
    # cores: d(sum)/d(cores) through the reconstruction with the reference's table gradient
    for g, group in enumerate(ttm.groups):
        names = ttm._group_tables[g]
        recon = sum((group.dense_weight(i) * ref.embedding_bags[n].weight.grad).sum() for i, n in enumerate(names))
        expected = torch.autograd.grad(recon, list(group.cores) + list(group.controllers))
        for got, want in zip(list(group.cores) + list(group.controllers), expected):
            torch.testing.assert_close(got.grad, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ttm.dense.embedding_bags["c"].weight.grad, ref.embedding_bags["c"].weight.grad)


def test_stacked_tables_are_looked_up_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = stacked.ttm_embedding_bag

    def spy(*args, **kwargs):
        calls.append(args[0][0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(stacked, "ttm_embedding_bag", spy)
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    ttm(kjt())
    assert sorted(calls) == [1, 2]  # one call per group: {a, b} and {d}


def test_meta_device_then_reset_parameters() -> None:
    ttm = TTMEmbeddingBagCollection(tables(), policy(), device="meta")
    assert all(p.is_meta for p in ttm.parameters())
    ttm.to_empty(device="cpu")
    ttm._device = torch.device("cpu")
    ttm.dense._device = torch.device("cpu")
    ttm.reset_parameters()
    assert all(torch.isfinite(p).all() for p in ttm.parameters())
    std = ttm.table_weight("d").std().item()
    assert 0.3 * (1 / 900) ** 0.5 < std < 3 * (1 / 900) ** 0.5  # variance 1 / (3 num_embeddings)
    assert ttm(kjt()).values().shape == (3, 40)


def test_state_dict_round_trip() -> None:
    torch.manual_seed(1)
    a = TTMEmbeddingBagCollection(tables(), policy())
    torch.manual_seed(2)
    b = TTMEmbeddingBagCollection(tables(), policy())
    assert not torch.allclose(a(kjt()).values(), b(kjt()).values())
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(kjt()).values(), b(kjt()).values())
    assert "groups.0.cores.0" in a.state_dict() and "dense.embedding_bags.c.weight" in a.state_dict()


def test_truncate_stacked_group_cuts_only_slices_dead_in_all_tables() -> None:
    ttm = TTMEmbeddingBagCollection(tables(), policy(rank=4))
    group = ttm.groups[0]
    with torch.no_grad():
        group.controllers[0][:, 3] = 0.0  # dead in both tables
        group.controllers[0][0, 2] = 0.0  # dead in table a only
    before = ttm(kjt()).values()
    assert group.truncate_ranks(1e-6)
    assert group.ranks == [3] and group.cores[0].shape == (2, 1, 10, 2, 3)
    torch.testing.assert_close(ttm(kjt()).values(), before, rtol=1e-5, atol=1e-6)


def test_from_embedding_bag_collection_is_exact_at_full_rank() -> None:
    ebc = EmbeddingBagCollection(tables())
    ttm = TTMEmbeddingBagCollection.from_embedding_bag_collection(ebc, policy(rank=100))
    assert ttm.compressed_tables() == ["a", "b", "d"]
    torch.testing.assert_close(ttm(kjt()).values(), ebc(kjt()).values(), rtol=1e-4, atol=1e-5)


def test_stacked_from_embeddings_exact() -> None:
    a, b = torch.randn(100, 8), torch.randn(90, 8)
    s = StackedTTMTables.from_embeddings([a, b], 64, row_shape=(10, 10), col_shape=(2, 4))
    torch.testing.assert_close(s.dense_weight(0), a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.dense_weight(1), b, rtol=1e-4, atol=1e-5)


def test_policy_keeps_small_tables_dense() -> None:
    configs = [
        EmbeddingBagConfig(name="big", embedding_dim=16, num_embeddings=200_000, feature_names=["x"]),
        EmbeddingBagConfig(name="small", embedding_dim=16, num_embeddings=500, feature_names=["y"]),
        EmbeddingBagConfig(name="forced", embedding_dim=16, num_embeddings=200_000, feature_names=["z"]),
    ]
    ttm = TTMEmbeddingBagCollection(configs, CompressionPolicy(rank=8, per_table={"forced": "dense"}), device="meta")
    assert ttm.compressed_tables() == ["big"]
    assert ttm.dense_tables() == ["small", "forced"]


# ---------------------------------------------------------------------------- bad input


def test_missing_feature_in_kjt() -> None:
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])
    )
    with pytest.raises(ValueError, match=r"lacks feature\(s\) \['f2', 'f3'\]"):
        ttm(features)


def test_kjt_key_missing_from_configs() -> None:
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    f = kjt()
    extra = KeyedJaggedTensor.from_lengths_sync(
        keys=f.keys() + ["zz"],
        values=torch.cat([f.values(), torch.tensor([1])]),
        lengths=torch.cat([f.lengths(), torch.tensor([1, 0, 0])]),
    )
    with pytest.raises(ValueError, match=r"\['zz'\] are in no table config"):
        ttm(extra)
    lenient = TTMEmbeddingBagCollection(tables(), policy(), allow_extra_keys=True)
    lenient.load_state_dict(ttm.state_dict())
    torch.testing.assert_close(lenient(extra).values(), ttm(f).values())


@pytest.mark.parametrize("feature,value", [("f3", 300), ("f2", -1), ("f0", 10)])
def test_id_out_of_range_names_feature_and_value(feature: str, value: int, lookup_path: str) -> None:
    # lookup_path "kernel": checked by one C++ pass (kernels.check_jagged); "torch": by tensor ops
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    f = kjt().to_dict()
    values = {k: jt.values().clone() for k, jt in f.items()}
    values[feature] = torch.cat([values[feature], torch.tensor([value])])
    lengths = {k: jt.lengths().clone() for k, jt in f.items()}
    lengths[feature][-1] += 1
    bad = KeyedJaggedTensor.from_lengths_sync(
        keys=list(f), values=torch.cat(list(values.values())), lengths=torch.cat(list(lengths.values()))
    )
    with pytest.raises(ValueError, match=rf"feature '{feature}' has id {value} out of range"):
        ttm(bad)


def test_bad_configs() -> None:
    with pytest.raises(ValueError, match="duplicate table names"):
        TTMEmbeddingBagCollection(tables() + tables()[:1], policy())
    with pytest.raises(ValueError, match="only SUM and MEAN"):
        TTMEmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"], pooling=PoolingType.NONE
                )
            ]
        )
    with pytest.raises(ValueError, match="per_table"):
        TTMEmbeddingBagCollection(tables(), CompressionPolicy(per_table={"a": "zip"}))


def _mixed_pair(weighted: bool, dense: bool = True):
    """Two alike collections of TTM groups and (with ``dense``) fused dense tables read by
    one table-batched lookup, as the DLRM trains them."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from comera_rec.integration import TableOverride
    from comera_rec.integration.distributed import EmbeddingOptimizerSpec, _fuse_dense_tables
    from tests.integration.helpers import SHAPE

    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=90, feature_names=["f2"]),
        EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=10, feature_names=["f0"]),
        EmbeddingBagConfig(name="d", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
    ]
    pol = CompressionPolicy(
        rank=4,
        min_rows_to_compress=95 if dense else 0,
        min_params_to_compress=0,
        min_gain=0.0,
        per_table={"a": TableOverride(shape=SHAPE)},
    )
    spec = EmbeddingOptimizerSpec(RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8})
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        ttm = TTMEmbeddingBagCollection(configs, pol, is_weighted=weighted)
        if dense:
            _fuse_dense_tables(ttm, spec, torch.device("cpu"))
        made.append(ttm)
    return made


@pytest.mark.parametrize("weighted", [False, True])
def test_dense_tables_called_directly_equal_the_fused_collection(weighted: bool, lookup_path: str) -> None:
    # b and c stay dense (below 95 rows) in one FBGEMM lookup; the collection hands it the
    # ids itself instead of calling FusedEmbeddingBagCollection.forward: same values, same
    # update (bit for bit through FBGEMM; to float rounding through the fused CPU kernel,
    # which sums the rows in another order)
    made = _mixed_pair(weighted)
    direct, wrapped = made
    assert direct._direct_dense_lookup() is not None
    wrapped._direct_dense_lookup = lambda: None  # FusedEmbeddingBagCollection.forward, as TorchRec calls it
    same = torch.equal if lookup_path == "torch" else functools.partial(torch.allclose, rtol=1e-6, atol=1e-7)
    for step in range(3):
        batch = kjt(weighted=weighted)
        outs = [m(batch).values() for m in made]
        assert same(outs[0], outs[1])
        before = {name: direct.table_weight(name).detach().clone() for name in ("b", "c")}
        grad = torch.randn(outs[0].shape)
        for out in outs:
            out.backward(grad)  # row-wise Adagrad updates the dense tables here
        for name in ("b", "c"):
            assert not torch.equal(direct.table_weight(name), before[name])  # the update happened
            assert same(direct.table_weight(name), wrapped.table_weight(name))


@pytest.mark.parametrize("weighted", [False, True])
def test_plain_dense_tables_called_one_by_one_equal_torchrec(weighted: bool, lookup_path: str) -> None:
    # two plain dense tables, one read by two features, mean and sum pooling (weighted bags:
    # sum only): with the kernels on, each nn.EmbeddingBag is called on the collection's own
    # slices and its output gathered directly; values and gradients as TorchRec's EBC gives
    pooling = PoolingType.SUM if weighted else PoolingType.MEAN
    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f1"]),
        EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=90, feature_names=["f0", "f2"], pooling=pooling),
        EmbeddingBagConfig(name="e", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
    ]
    pol = CompressionPolicy(rank=4, min_rows_to_compress=95, min_params_to_compress=0, min_gain=0.0)
    ttm = TTMEmbeddingBagCollection(configs, pol, is_weighted=weighted)
    assert ttm.dense_tables() == ["c"] and ttm.compressed_tables() == ["a", "e"]
    calls = []
    real = ttm._plain_dense_pooled
    ttm._plain_dense_pooled = lambda stream: calls.append(1) or real(stream)  # type: ignore[method-assign]
    ref = reference_ebc(ttm, configs, weighted=weighted)
    features = kjt(weighted=weighted)
    out, expected = ttm(features), ref(features)
    assert bool(calls) == (lookup_path == "kernel")
    assert out.keys() == expected.keys() == ["f1", "f0", "f2", "f3"]
    torch.testing.assert_close(out.values(), expected.values(), rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.values().shape)
    (out.values() * grad).sum().backward()
    (expected.values() * grad).sum().backward()
    torch.testing.assert_close(ttm.dense.embedding_bags["c"].weight.grad, ref.embedding_bags["c"].weight.grad)


def _dense_pair(pooling: PoolingType, weighted: bool, other_pooling: PoolingType | None = None):
    # tables a (100 rows, f1) and c (90 rows, f0 and f2) dense, e (300 rows, f3) compressed
    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f1"], pooling=pooling),
        EmbeddingBagConfig(
            name="c", embedding_dim=8, num_embeddings=90, feature_names=["f0", "f2"], pooling=other_pooling or pooling
        ),
        EmbeddingBagConfig(name="e", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
    ]
    pol = CompressionPolicy(rank=4, min_rows_to_compress=200, min_params_to_compress=0, min_gain=0.0)
    ttm = TTMEmbeddingBagCollection(configs, pol, is_weighted=weighted).eval()
    assert ttm.dense_tables() == ["a", "c"] and ttm.compressed_tables() == ["e"]
    return ttm, reference_ebc(ttm, configs, weighted=weighted)


@pytest.mark.parametrize(
    "pooling,weighted", [(PoolingType.SUM, False), (PoolingType.MEAN, False), (PoolingType.SUM, True)]
)
def test_scoring_stacks_the_dense_tables_into_one_lookup(
    pooling: PoolingType, weighted: bool, lookup_path: str
) -> None:
    # scoring inside cached_weights with the kernels on: the dense tables stacked once and
    # every dense feature pooled in one embedding_bag; the values TorchRec's EBC gives
    ttm, ref = _dense_pair(pooling, weighted)
    features = kjt(weighted=weighted, batch=5)
    with torch.inference_mode():
        expected = ref(features).values()
        unscoped = ttm(features).values()  # outside the scope: table by table, nothing kept
        with cached_weights():
            scored = ttm(features).values()
            kept = len(derived_cache(ttm, "dense_tables"))
            again = ttm(features).values()
    assert kept == (1 if lookup_path == "kernel" else 0)
    for got in (unscoped, scored, again):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_stacked_dense_tables_follow_an_in_place_write() -> None:
    ttm, _ = _dense_pair(PoolingType.SUM, False)
    features = kjt(batch=4)
    bags = ttm.dense.embedding_bags
    with torch.no_grad(), cached_weights():
        before = ttm(features).values()
        first = ttm._merged_dense_tables()[0]
        assert ttm._merged_dense_tables()[0] is first  # kept
        bags["c"].weight.mul_(3.0)  # moves the version counter: stacked again
        after = ttm(features).values()
        second = ttm._merged_dense_tables()[0]
    assert second is not first
    torch.testing.assert_close(second, torch.cat([bags["a"].weight, bags["c"].weight]))
    assert not torch.allclose(before, after)
    with torch.no_grad():
        torch.testing.assert_close(after, ttm(features).values())  # the table-by-table path agrees


def test_dense_tables_of_different_pooling_are_not_stacked() -> None:
    ttm, ref = _dense_pair(PoolingType.SUM, False, other_pooling=PoolingType.MEAN)
    features = kjt(batch=4)
    with torch.inference_mode(), cached_weights():
        assert ttm._merged_dense_tables() is None
        torch.testing.assert_close(ttm(features).values(), ref(features).values(), rtol=1e-5, atol=1e-6)


def test_dense_tables_above_the_stacking_limit_keep_their_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    import comera_rec.integration.collection as collection

    ttm, ref = _dense_pair(PoolingType.SUM, False)
    tables_bytes = sum(b.weight.numel() * 4 for b in ttm.dense.embedding_bags.values())
    monkeypatch.setattr(collection, "STACKED_DENSE_MAX_BYTES", tables_bytes - 1)
    features = kjt(batch=4)
    with torch.inference_mode(), cached_weights():
        assert ttm._merged_dense_tables() is None  # no copy of tables this large
        torch.testing.assert_close(ttm(features).values(), ref(features).values(), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(collection, "STACKED_DENSE_MAX_BYTES", tables_bytes)
    with torch.inference_mode(), cached_weights():
        assert ttm._merged_dense_tables() is not None


def test_stacked_dense_tables_take_an_empty_batch() -> None:
    ttm, ref = _dense_pair(PoolingType.SUM, False)
    empty = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2", "f3"], values=torch.zeros(0, dtype=torch.long), lengths=torch.zeros(0, dtype=torch.long)
    )
    with torch.inference_mode(), cached_weights():
        assert ttm._merged_dense_tables() is not None
        out = ttm(empty)
    assert out.values().shape == (0, 32)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dense", [True, False])
def test_lookups_writing_into_the_output_equal_the_gathered_output(
    weighted: bool, dense: bool, kernels_on, monkeypatch: pytest.MonkeyPatch
) -> None:
    # training on CPU, every lookup writes its bags into the output at its keys' columns
    # (no gather): the same values, core and controller gradients and table updates as
    # the lookups' own outputs gathered, bit for bit, over steps
    in_place, gathered = _mixed_pair(weighted, dense)
    assert (in_place.dense is not None) == dense and len(in_place.groups) >= 1
    monkeypatch.setattr(gathered, "_lookups_write_in_place", lambda *args: False)
    calls = []
    original = in_place._pool_in_place
    monkeypatch.setattr(in_place, "_pool_in_place", lambda *a: calls.append(1) or original(*a))
    for step in range(3):
        batch = kjt(weighted=weighted, seed=step)
        outs = [m(batch) for m in (in_place, gathered)]
        assert outs[0].keys() == outs[1].keys() and outs[0].length_per_key() == outs[1].length_per_key()
        assert torch.equal(outs[0].values(), outs[1].values())
        grad = torch.randn(outs[0].values().shape, generator=torch.Generator().manual_seed(10 + step))
        for out in outs:
            out.values().backward(grad)
        for a, b in zip(in_place.parameters(), gathered.parameters()):
            assert torch.equal(a, b)
            assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
    assert len(calls) == 3
    if dense:
        for name in ("b", "c"):
            assert torch.equal(in_place.table_weight(name), gathered.table_weight(name))


def test_scoring_and_mean_pooling_keep_the_gather(kernels_on, monkeypatch: pytest.MonkeyPatch) -> None:
    ttm, _ = _mixed_pair(weighted=False)
    calls = []
    original = ttm._pool_in_place
    monkeypatch.setattr(ttm, "_pool_in_place", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        ttm(kjt())
    assert calls == []  # scoring reads its kept halves, gathered after
    mean = TTMEmbeddingBagCollection(tables(PoolingType.MEAN), policy())
    monkeypatch.setattr(mean, "_pool_in_place", lambda *a: calls.append(1) or original(*a))
    mean(kjt()).values().sum().backward()
    assert calls == []  # mean bags are divided after the lookup


# ------------------------------------------------------- variable batch sizes per feature (VBE)

STRIDES = {"f0": 2, "f1": 3, "f2": 1, "f3": 4}  # each feature's own bags
VBE_BATCH = 5  # the samples, each reading one bag of every feature (the inverse indices)


def vbe_kjt(weighted: bool = False, seed: int = 0) -> KeyedJaggedTensor:
    """The helpers' four features with a batch size each (an empty bag among them) and the
    inverse indices that map the ``VBE_BATCH`` samples onto them."""
    g = torch.Generator().manual_seed(seed)
    bounds = {"f0": 10, "f1": 100, "f2": 90, "f3": 300}
    lengths = [torch.randint(0, 4, (STRIDES[f],), generator=g) for f in bounds]
    lengths[0][0] = 0
    values = torch.cat(
        [torch.randint(0, n, (int(lens.sum()),), generator=g) for lens, n in zip(lengths, bounds.values())]
    )
    inverse = torch.stack([torch.randint(0, STRIDES[f], (VBE_BATCH,), generator=g) for f in bounds])
    return KeyedJaggedTensor(
        keys=list(bounds),
        values=values,
        lengths=torch.cat(lengths),
        weights=torch.rand(values.shape, generator=g) if weighted else None,
        stride_per_key_per_rank=[[STRIDES[f]] for f in bounds],
        inverse_indices=(list(bounds), inverse),
    )


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_variable_batch_sizes_match_torchrec_ebc(pooling: PoolingType, lookup_path: str) -> None:
    # TorchRec's EBC pools each feature's own bags, then picks them by the inverse indices
    ttm = TTMEmbeddingBagCollection(tables(pooling), policy())
    ref = reference_ebc(ttm, tables(pooling))
    features = vbe_kjt()
    out, expected = ttm(features), ref(features)
    assert out.values().shape == (VBE_BATCH, 40) and out.keys() == expected.keys()
    torch.testing.assert_close(out.values(), expected.values(), rtol=1e-5, atol=1e-6)


def test_weighted_variable_batch_sizes_match_torchrec_ebc(lookup_path: str) -> None:
    configs = [t for t in tables() if t.name != "b"]
    ttm = TTMEmbeddingBagCollection(configs, policy(), is_weighted=True, allow_extra_keys=True)
    ref = reference_ebc(ttm, [t for t in tables() if t.name != "b"], weighted=True)
    features = vbe_kjt(weighted=True)
    torch.testing.assert_close(ttm(features).values(), ref(features).values(), rtol=1e-5, atol=1e-6)


def test_variable_batch_size_gradients_match_torchrec_ebc(lookup_path: str) -> None:
    # a bag that several samples read gets the sum of their gradients, as in TorchRec
    check_gradients_against_torchrec(vbe_kjt(seed=1), batch=VBE_BATCH)


def test_variable_batch_sizes_need_inverse_indices() -> None:
    ttm = TTMEmbeddingBagCollection(tables(), policy())
    features = vbe_kjt()
    bare = KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        lengths=features.lengths(),
        stride_per_key_per_rank=features.stride_per_key_per_rank(),
    )
    with pytest.raises(ValueError, match="variable batch sizes per feature needs inverse_indices"):
        ttm(bare)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_keys=st.integers(1, 3), batch=st.integers(1, 5), weighted=st.booleans())
def test_one_batch_size_gives_each_sample_its_bag(data, num_keys: int, batch: int, weighted: bool) -> None:
    keys = [f"k{i}" for i in range(num_keys)]
    strides = [data.draw(st.integers(1, 4)) for _ in keys]
    bags = [[data.draw(st.lists(st.integers(0, 50), max_size=3)) for _ in range(s)] for s in strides]
    inverse = [[data.draw(st.integers(0, s - 1)) for _ in range(batch)] for s in strides]
    ids = [i for per_key in bags for bag in per_key for i in bag]
    features = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(ids, dtype=torch.long),
        lengths=torch.tensor([len(bag) for per_key in bags for bag in per_key], dtype=torch.long),
        weights=torch.tensor(ids, dtype=torch.float) / 7 if weighted else None,
        stride_per_key_per_rank=[[s] for s in strides],
        inverse_indices=(keys, torch.tensor(inverse)),
    )
    one = one_batch_size(features)
    assert one.keys() == keys and one.stride() == batch and not one.variable_stride_per_key()
    for k, key in enumerate(keys):
        got = one[key]
        for b in range(batch):
            want = bags[k][inverse[k][b]]
            lo, hi = int(got.offsets()[b]), int(got.offsets()[b + 1])
            assert got.values()[lo:hi].tolist() == want
            if weighted:
                assert got.weights()[lo:hi].tolist() == (torch.tensor(want, dtype=torch.float) / 7).tolist()
