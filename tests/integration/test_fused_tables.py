"""A FusedEmbeddingBagCollection's tables through the fused CPU row-wise Adagrad kernel
(integration/fused_tables.py) against the same collection trained by FBGEMM."""

from __future__ import annotations

import pytest
import torch
from torchrec.models.dlrm import SparseArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.dlrm.interaction import FlatSparseArch
from comera_rec.integration.fused_tables import _plain_tbe, fused_tables_lookup, single_lookup
from comera_rec.tensor import kernels

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py

B = 16
ROWS = {"f0": 50, "g": 50, "f1": 7, "f2": 300, "f3": 5000}


def configs(dim_of_f2: int = 8) -> list[EmbeddingBagConfig]:
    # table t0 is read by two features; dims differ between tables
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=50, feature_names=["f0", "g"]),
        EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=7, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=dim_of_f2, num_embeddings=300, feature_names=["f2"]),
        EmbeddingBagConfig(name="t3", embedding_dim=16, num_embeddings=5000, feature_names=["f3"]),
    ]


def fused(optimizer_kwargs=None, dim_of_f2: int = 8, weighted: bool = False) -> FusedEmbeddingBagCollection:
    torch.manual_seed(0)
    return FusedEmbeddingBagCollection(
        tables=configs(dim_of_f2),
        optimizer_type=RowWiseAdagrad,
        is_weighted=weighted,
        optimizer_kwargs=optimizer_kwargs or {"lr": 0.05, "eps": 1e-8},
        device=torch.device("cpu"),
    )


def batch(features: list[str], seed: int, weighted: bool = False, max_len: int = 3) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(features) * B,), generator=g)
    ids = torch.cat(
        [
            torch.randint(0, ROWS[f], (int(lengths[i * B : (i + 1) * B].sum()),), generator=g)
            for i, f in enumerate(features)
        ]
    )
    weights = torch.rand(ids.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=features, values=ids, lengths=lengths, weights=weights)


FEATURES = ["f0", "g", "f1", "f2", "f3"]


def state(collection: FusedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    tbe = single_lookup(collection, FEATURES)._emb_module
    return {
        "weights": tbe.weights_host.detach().clone(),
        "momentum": tbe.momentum1_host.clone(),
        "iter": tbe.iter.clone(),
        "step": torch.tensor(tbe.step),
    }


@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_and_update_match_fbgemm_over_steps(weighted: bool) -> None:
    kernel, reference = fused(weighted=weighted), fused(weighted=weighted)
    lk, lr = single_lookup(kernel, FEATURES), single_lookup(reference, FEATURES)
    assert lk is not None and _plain_tbe(lk) is not None
    for step in range(4):
        kjt = batch(FEATURES, step, weighted)
        w = kjt.weights() if weighted else None
        out = fused_tables_lookup(lk, kjt.values(), kjt.lengths(), w, B)
        kernels.set_cpu_kernel_enabled(False)  # the same call through FBGEMM
        want = fused_tables_lookup(lr, kjt.values(), kjt.lengths(), w, B)
        kernels.set_cpu_kernel_enabled(True)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        g = torch.randn(out.shape)
        out.backward(g)
        want.backward(g)
        got, ref = state(kernel), state(reference)
        torch.testing.assert_close(got["weights"], ref["weights"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["momentum"], ref["momentum"], rtol=1e-5, atol=1e-7)
        assert torch.equal(got["iter"], ref["iter"]) and torch.equal(got["step"], ref["step"])
    # the fused optimizer's state (what a checkpoint holds) reads the same buffers
    torch.testing.assert_close(
        kernel.fused_optimizer().state_dict()["state"],
        reference.fused_optimizer().state_dict()["state"],
        rtol=1e-5,
        atol=1e-7,
    )


def test_other_optimizer_settings_stay_with_fbgemm() -> None:
    decayed = fused({"lr": 0.05, "eps": 1e-8, "weight_decay": 0.01})
    lookup = single_lookup(decayed, FEATURES)
    assert lookup is not None and _plain_tbe(lookup) is None
    # and the call still trains through FBGEMM
    kjt = batch(FEATURES, 0)
    before = state(decayed)["weights"]
    fused_tables_lookup(lookup, kjt.values(), kjt.lengths(), None, B).sum().backward()
    assert not torch.equal(state(decayed)["weights"], before)


def test_single_lookup_needs_the_features_in_order() -> None:
    collection = fused()
    assert single_lookup(collection, FEATURES) is not None
    assert single_lookup(collection, list(reversed(FEATURES))) is None
    assert single_lookup(torch.nn.Linear(2, 2), FEATURES) is None


def test_flat_sparse_arch_matches_torchrec_sparse_arch_and_its_update() -> None:
    # one dim for the dot interaction's arch
    flat, plain = FlatSparseArch(fused(dim_of_f2=16)), SparseArch(fused(dim_of_f2=16))
    for step in range(3):
        kjt = batch(FEATURES, 10 + step)
        got, want = flat(kjt), plain(kjt)
        assert got.shape == want.shape == (B, 5, 16)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        g = torch.randn(got.shape)
        got.backward(g)
        want.backward(g)
    torch.testing.assert_close(
        state(flat.embedding_bag_collection)["weights"],
        state(plain.embedding_bag_collection)["weights"],
        rtol=1e-6,
        atol=1e-6,
    )


def test_id_outside_its_table_is_named_through_the_arch() -> None:
    arch = FlatSparseArch(fused(dim_of_f2=16))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES,
        values=torch.tensor([1, 2, 3, 300, 4]),
        lengths=torch.tensor([1] * 5),
    )
    with pytest.raises(RuntimeError, match=r"id 300 of feature 3 out of range \[0, 300\)"):
        arch(kjt)


@pytest.mark.parametrize("through", ["kernel", "fbgemm"])
def test_bags_laid_out_for_the_caller_equal_the_packed_ones(through: str) -> None:
    # out_columns: each feature's bags at the caller's columns of a wider output; the same
    # values and (through the output's gradient at those columns) the same update
    laid, packed = fused(dim_of_f2=16), fused(dim_of_f2=16)
    ll, lp = single_lookup(laid, FEATURES), single_lookup(packed, FEATURES)
    width, cols = 7 * 16, [96, 16, 48, 0, 64]
    kernels.set_cpu_kernel_enabled(through == "kernel")
    try:
        for step in range(3):
            kjt = batch(FEATURES, 20 + step)
            got = fused_tables_lookup(ll, kjt.values(), kjt.lengths(), None, B, out_columns=(width, cols))
            want = fused_tables_lookup(lp, kjt.values(), kjt.lengths(), None, B)
            assert got.shape == (B, width)
            g = torch.randn(want.shape, generator=torch.Generator().manual_seed(step))
            laid_g = torch.zeros(B, width)
            for f, c in enumerate(cols):
                assert torch.equal(got[:, c : c + 16], want[:, 16 * f : 16 * (f + 1)])
                laid_g[:, c : c + 16] = g[:, 16 * f : 16 * (f + 1)]
            got.backward(laid_g)
            want.backward(g)
            assert torch.equal(state(laid)["weights"], state(packed)["weights"])
    finally:
        kernels.set_cpu_kernel_enabled(True)
