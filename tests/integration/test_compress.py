"""TT MLPs, the TT cross net, compress() on TorchRec's own DLRM, and size accounting."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.integration import CompressionPolicy, TTMEmbeddingBagCollection
from comera_rec.integration.compress import compress, model_size
from comera_rec.integration.mlp import TTLowRankCrossNet, tt_mlp
from comera_rec.tensor.linear import TTLinear


def test_tt_mlp_mirrors_torchrec_mlp() -> None:
    mlp = tt_mlp(13, [512, 256, 64, 16], rank=16)
    kinds = [type(p._linear).__name__ for p in mlp._mlp]
    assert kinds == ["Linear", "TTLinear", "TTLinear", "Linear"]
    assert [p._linear.out_features for p in mlp._mlp] == [512, 256, 64, 16]
    out = mlp(torch.randn(4, 13))
    assert out.shape == (4, 16) and bool((out >= 0).all())  # relu on the last layer, like MLP


def test_linear_min_gain_sets_the_layers_bar_apart_from_the_tables() -> None:
    # 256 -> 64 at rank 32: 1.54x fewer parameters than dense and fewer multiply-adds per row
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU())
    report = compress(model, CompressionPolicy(rank=32, min_gain=2.0))
    assert type(model[0]) is nn.Linear
    assert "256->64: TT at rank 32 would not be 2.0x smaller" in report.kept[0].reason
    policy = CompressionPolicy(rank=32, min_gain=2.0, linear_min_gain=1.5)
    assert policy.mlp_min_gain == 1.5 and CompressionPolicy(min_gain=3.0).mlp_min_gain == 3.0
    torch.manual_seed(0)
    dense = nn.Linear(256, 64)
    model = nn.Sequential(dense)
    compress(model, policy)
    assert isinstance(model[0], TTLinear) and max(model[0].ranks) == 32
    assert 1.5 <= (256 * 64 + 64) / sum(p.numel() for p in model[0].parameters()) < 2.0


def test_tt_crossnet_from_crossnet_is_exact_at_full_rank() -> None:
    net = LowRankCrossNet(in_features=24, num_layers=2, low_rank=12)
    with torch.no_grad():
        for b in net.bias:
            b.normal_()
    tt = TTLowRankCrossNet.from_crossnet(net, tt_rank=64, min_gain=0.0)
    assert all(isinstance(v, TTLinear) for v in tt.V)
    x = torch.randn(5, 24)
    torch.testing.assert_close(tt(x), net(x), rtol=1e-4, atol=1e-5)


def _dlrm(dcn: bool = False) -> DLRM:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate([400, 300, 20])
    ]
    ebc = EmbeddingBagCollection(tables)
    if dcn:
        return DLRM_DCN(ebc, 6, [32, 8], [32, 1], dcn_num_layers=2, dcn_low_rank_dim=16)
    return DLRM(ebc, 6, [32, 8], [32, 1])


def _inputs() -> tuple[torch.Tensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(3)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"],
        values=torch.cat([torch.randint(0, n, (6,), generator=g) for n in (400, 300, 20)]),
        lengths=torch.tensor([2, 1, 3, 0] * 3),
    )
    return torch.randn(4, 6, generator=g), kjt


def test_compress_torchrec_dlrm_full_rank_keeps_outputs() -> None:
    for dcn in (False, True):
        model = _dlrm(dcn)
        dense, sparse = _inputs()
        expected = model(dense, sparse)
        policy = CompressionPolicy(rank=512, min_rows_to_compress=100, min_params_to_compress=0, min_gain=0.0)
        report = compress(model, policy)
        names = [m.name for m in report.modules]
        assert "sparse_arch.embedding_bag_collection" in names
        assert isinstance(model.sparse_arch.embedding_bag_collection, TTMEmbeddingBagCollection)
        assert model.sparse_arch.embedding_bag_collection.dense_tables() == ["t2"]
        assert any(isinstance(m, TTLinear) for m in model.modules())
        if dcn:
            assert isinstance(model.inter_arch.crossnet, TTLowRankCrossNet)
        torch.testing.assert_close(model(dense, sparse), expected, rtol=1e-4, atol=1e-4)
        assert "total" in str(report)


def test_compress_at_low_rank_reports_savings() -> None:
    model = _dlrm()
    before = sum(p.numel() for p in model.parameters())
    report = compress(
        model, CompressionPolicy(rank=2, min_rows_to_compress=100, min_params_to_compress=0, min_gain=1.5)
    )
    after = sum(p.numel() for p in model.parameters())
    assert report.params_before - report.params_after == before - after > 0
    assert all(m.ratio >= 1.5 for m in report.modules)
    size = model_size(model)
    assert size.num_parameters == after and size.dense_num_parameters == before
    assert size.compression_ratio > 1


def test_model_size_of_tt_layer() -> None:
    size = model_size(nn.Sequential(TTLinear(512, 512, rank=8)))
    assert size.dense_num_parameters == 512 * 512 + 512
    assert size.compression_ratio > 10


class _Mixed(nn.Module):
    """A DLRM beside a TorchRec sequence collection (compressed too) and modules compress()
    leaves alone: a plain torch embedding and an already fused collection."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        self.dlrm = _dlrm()
        self.plain = nn.EmbeddingBag(50, 8)
        self.sequence = EmbeddingCollection(
            [EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=500, feature_names=["s"])]
        )
        self.fused = FusedEmbeddingBagCollection(
            [EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=500, feature_names=["u"])],
            optimizer_type=torch.optim.SGD,
            optimizer_kwargs={"lr": 0.1},
            device=torch.device("cpu"),
        )


def test_compress_reports_every_module_it_leaves_dense_and_why() -> None:
    model = _Mixed()
    policy = CompressionPolicy(rank=4, min_rows_to_compress=100, min_params_to_compress=0, min_gain=2.0)
    report = compress(model, policy)
    kept = {k.name: k for k in report.kept}
    assert "rows < min_rows_to_compress=100" in kept["dlrm.sparse_arch.embedding_bag_collection.t2"].reason
    assert kept["dlrm.sparse_arch.embedding_bag_collection.t2"].params == 20 * 8
    assert "plain torch embedding" in kept["plain"].reason
    assert "sequence" not in kept  # an EmbeddingCollection is compressed (TTMEmbeddingCollection)
    assert {m.name: m.kind for m in report.modules}["sequence"] == "TTMEmbeddingCollection"
    assert "already fused" in kept["fused"].reason
    # DLRM's 6->32 bottom layer stays dense: TT would not pay at rank 4
    small = [k for k in report.kept if k.kind == "Linear" and "6->32" in k.reason]
    assert small and "2.0x smaller (linear_min_gain, else min_gain)" in small[0].reason
    assert not any(k.name.startswith(("sequence.", "fused.")) for k in report.kept)  # no children listed
    text = str(report)
    assert "left dense:" in text and "plain (EmbeddingBag, 400 parameters)" in text


def test_policy_reasons_for_dense_tables() -> None:
    from comera_rec.integration.policy import plan_table

    assert (
        "per_table entry says dense" in plan_table("t", 10**6, 16, CompressionPolicy(per_table={"t": "dense"})).reason
    )
    assert "parameters < min_params_to_compress" in plan_table("t", 20_000, 16, CompressionPolicy()).reason
    plan = plan_table("t", 20_000, 16, CompressionPolicy(min_params_to_compress=0, min_gain=1e6))
    assert not plan.compressed and "min_gain=1000000.0" in plan.reason
    assert plan_table("t", 20_000, 16, CompressionPolicy(min_params_to_compress=0)).reason == ""
