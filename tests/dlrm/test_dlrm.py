"""DLRM assembly from DLRMConfig: dense and compressed, through TorchRec's DLRMTrain."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.dlrm import KAGGLE_TABLE_SIZES, DLRMConfig, build_dlrm, build_dlrm_train, dlrm_size, make_dlrm
from comera_rec.integration import TTMEmbeddingBagCollection
from comera_rec.integration.mlp import TTLowRankCrossNet
from comera_rec.tensor.linear import TTLinear

SIZES = [5000, 3000, 40]


def _config(**kw) -> DLRMConfig:
    base = dict(
        table_sizes=SIZES,
        embedding_dim=8,
        dense_in_features=4,
        bottom_mlp=[64, 8],
        top_mlp=[64, 32, 1],
        rank=4,
        min_rows_to_compress=1000,
        min_params_to_compress=0,
        dcn_num_layers=2,
        dcn_low_rank=32,
    )
    return DLRMConfig(**{**base, **kw})


def _batch(batch: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 3, (len(SIZES), batch), generator=g)
    values = torch.cat([torch.randint(0, n, (int(lengths[i].sum()),), generator=g) for i, n in enumerate(SIZES)])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"cat_{i}" for i in range(len(SIZES))], values=values, lengths=lengths.reshape(-1)
    )
    return Batch(torch.rand(batch, 4, generator=g), kjt, torch.randint(0, 2, (batch,), generator=g))


def test_kaggle_defaults() -> None:
    cfg = DLRMConfig()
    assert cfg.table_sizes == list(KAGGLE_TABLE_SIZES) and sum(cfg.table_sizes) == 33_762_577
    assert (cfg.embedding_dim, cfg.dense_in_features, cfg.bottom_mlp, cfg.top_mlp) == (
        16,
        13,
        [512, 256, 64, 16],
        [512, 256, 1],
    )
    mlperf = DLRMConfig.mlperf_dcn()
    assert (mlperf.embedding_dim, mlperf.interaction, mlperf.dcn_low_rank) == (128, "dcn", 512)


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
@pytest.mark.parametrize("compressed", [False, True])
def test_runs_through_dlrm_train(interaction: str, compressed: bool) -> None:
    torch.manual_seed(0)
    train = build_dlrm_train(_config(interaction=interaction, compressed=compressed))
    assert isinstance(train, DLRMTrain)
    ebc = train.model.sparse_arch.embedding_bag_collection
    if compressed:
        assert isinstance(ebc, TTMEmbeddingBagCollection) and ebc.dense_tables() == ["t_cat_2"]
        assert isinstance(train.model.over_arch.model[0]._mlp[0]._linear, TTLinear)
        if interaction == "dcn":
            assert isinstance(train.model.inter_arch.crossnet, TTLowRankCrossNet)
    if interaction == "dcn":
        assert isinstance(train.model, DLRM_DCN)
    batch = _batch()
    loss, (detached, logits, labels) = train(batch)
    assert loss.shape == () and logits.shape == (6,) and torch.equal(labels, batch.labels)
    loss.backward()
    assert all(p.grad is not None for p in train.parameters())


def test_kaggle_compressed_size_on_meta() -> None:
    model = build_dlrm(DLRMConfig.kaggle(), device="meta")
    size = dlrm_size(model)
    assert size.dense_num_bytes > 2.1e9  # 33.8M rows x 16 x fp32 plus MLPs
    assert size.compression_ratio > 100
    dense = dlrm_size(build_dlrm(DLRMConfig.kaggle(compressed=False), device="meta"))
    assert dense.num_parameters == size.dense_num_parameters


def test_kaggle_bottom_mlp_is_tt_down_to_64() -> None:
    # mlp_min_gain=1.5 lets through the 256 -> 64 layer (1.54x smaller at rank 32), not 64 -> 16
    def kinds(cfg: DLRMConfig) -> list[str]:
        mlp = build_dlrm(cfg, device="meta").dense_arch.model
        return [type(p._linear).__name__ for p in mlp._mlp]

    assert DLRMConfig.kaggle().policy().mlp_min_gain == 1.5
    assert kinds(DLRMConfig.kaggle()) == ["NarrowLinear", "TTLinear", "TTLinear", "Linear"]
    assert kinds(DLRMConfig.kaggle(mlp_min_gain=None)) == ["NarrowLinear", "TTLinear", "Linear", "Linear"]
    assert DLRMConfig.kaggle(mlp_min_gain=None).policy().mlp_min_gain == 2.0


def test_mismatched_embedding_dims() -> None:
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10, feature_names=["a"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["b"]),
    ]
    with pytest.raises(ValueError, match=r"same embedding_dim; t0 has 8 but t1 \(4\)"):
        make_dlrm(tables, dense_in_features=3, bottom_mlp=[8], top_mlp=[4, 1])
    with pytest.raises(ValueError, match=r"bottom MLP's last layer \(16\) must equal the embedding_dim \(8\)"):
        build_dlrm(_config(bottom_mlp=[64, 16]))
    with pytest.raises(ValueError, match="feature_names"):
        build_dlrm(_config(feature_names=["x"]))


def test_out_of_range_id_through_dlrm() -> None:
    train = build_dlrm_train(_config())
    batch = _batch()
    values = batch.sparse_features.values().clone()
    values[0] = 5000
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=batch.sparse_features.keys(), values=values, lengths=batch.sparse_features.lengths()
    )
    with pytest.raises(ValueError, match="feature 'cat_0' has id 5000 out of range"):
        train(Batch(batch.dense_features, kjt, batch.labels))
