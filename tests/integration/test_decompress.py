"""decompress(): compressed TorchRec DLRM / DLRM_DCN back to stock modules, checked against
a float64 reconstruction of every TT / TTM weight and against a freshly built stock model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import comera_rec
from comera_rec.integration import CompressionPolicy, TTMEmbeddingBagCollection, compress, decompress
from comera_rec.integration.mlp import TTLowRankCrossNet
from comera_rec.tensor.linear import NarrowLinear, TTLinear
from comera_rec.tensor.train import TensorTrainModule

SIZES = (400, 300, 20)
# low rank, everything that can be compressed is: tables of >= 100 rows, MLP layers, DCN projections
POLICY = CompressionPolicy(rank=3, min_rows_to_compress=100, min_params_to_compress=0, min_gain=0.0)


def _dlrm(dcn: bool, seed: int = 0) -> DLRM:
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(SIZES)
    ]
    ebc = EmbeddingBagCollection(tables)
    if dcn:
        return DLRM_DCN(ebc, 6, [32, 8], [32, 1], dcn_num_layers=2, dcn_low_rank_dim=16)
    return DLRM(ebc, 6, [32, 8], [32, 1])


def _inputs() -> tuple[torch.Tensor, KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(3)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"],
        values=torch.cat([torch.randint(0, n, (6,), generator=g) for n in SIZES]),
        lengths=torch.tensor([2, 1, 3, 0] * 3),
    )
    return torch.randn(4, 6, generator=g), kjt


# ---------------------------------------------------------------- float64 reference
def _chain(cores: list[torch.Tensor], controllers: list[torch.Tensor]) -> torch.Tensor:
    """Multiply out one train in float64: cores ``(r, *modes, r')``, controller k scaling bond k."""
    full = cores[0].double()
    for core, ctrl in zip(cores[1:], controllers):
        full = torch.tensordot(full * ctrl.double(), core.double(), dims=([-1], [0]))
    return full.squeeze(0).squeeze(-1)


def _tt_linear_weight(layer: TTLinear) -> torch.Tensor:
    """``(out, in)`` in float64: the train is ``W^T`` padded to ``(N_in, N_out)``."""
    full = _chain(list(layer.cores), list(layer.controllers))
    n_in, n_out = math.prod(layer.in_shape), math.prod(layer.out_shape)
    return full.reshape(n_in, n_out)[: layer.in_features, : layer.out_features].t()


def _ttm_tables(ebc: TTMEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    """Every TTM table in float64; a stacked core is ``(T, r, n, m, r')``, a controller ``(T, r)``."""
    rows = {t.name: (t.num_embeddings, t.embedding_dim) for t in ebc.embedding_bag_configs()}
    out = {}
    for group, names in zip(ebc.groups, ebc._group_tables):
        d = len(group.cores)
        for t, name in enumerate(names):
            full = _chain([c[t] for c in group.cores], [c[t] for c in group.controllers])  # (n1, m1, ..., nd, md)
            full = full.permute(*range(0, 2 * d, 2), *range(1, 2 * d, 2))  # (n1..nd, m1..md)
            n = math.prod(full.shape[:d])
            num, dim = rows[name]
            out[name] = full.reshape(n, -1)[:num, :dim]
    return out


def _reference(model: nn.Module) -> dict[str, torch.Tensor]:
    """Dense state-dict entries every compressed module should become, in float64."""
    ref: dict[str, torch.Tensor] = {}
    crossnets = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, TTLowRankCrossNet))
    for name, m in model.named_modules():
        if isinstance(m, TTMEmbeddingBagCollection):
            for table, w in _ttm_tables(m).items():
                ref[f"{name}.embedding_bags.{table}.weight"] = w
        elif isinstance(m, TTLowRankCrossNet):
            for k, (v, w) in enumerate(zip(m.V, m.W)):
                ref[f"{name}.V_kernels.{k}"] = _tt_linear_weight(v) if isinstance(v, TTLinear) else v.weight.double()
                ref[f"{name}.W_kernels.{k}"] = _tt_linear_weight(w) if isinstance(w, TTLinear) else w.weight.double()
        elif isinstance(m, TTLinear) and not name.startswith(crossnets):  # a cross net's: done above
            ref[f"{name}.weight"] = _tt_linear_weight(m)
    return ref


def _check_against_reference(model: nn.Module, ref: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert ref
    for key, expected in ref.items():
        assert state[key].dtype == torch.float32, key
        torch.testing.assert_close(state[key].double(), expected, rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("dcn", [False, True], ids=["dlrm", "dlrm_dcn"])
def test_round_trip_keeps_outputs_and_loads_into_stock_torchrec(dcn: bool) -> None:
    model = _dlrm(dcn)
    dense, sparse = _inputs()
    compress(model, POLICY)
    assert any(isinstance(m, TensorTrainModule) for m in model.modules())
    compressed_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        expected = model(dense, sparse)
    ref = _reference(model)

    report = decompress(model)

    assert not any(
        isinstance(m, (TensorTrainModule, TTMEmbeddingBagCollection, TTLowRankCrossNet)) for m in model.modules()
    )
    assert type(model.sparse_arch.embedding_bag_collection) is EmbeddingBagCollection
    if dcn:
        assert type(model.inter_arch.crossnet) is LowRankCrossNet
    names = [m.name for m in report.modules]
    assert names[0] == "sparse_arch.embedding_bag_collection"
    assert report.modules[0].kind == "EmbeddingBagCollection"
    assert ("inter_arch.crossnet" in names) == dcn
    stock = _dlrm(dcn, seed=1)  # other initial weights: everything must come from the state dict
    assert report.params_after - report.params_before == sum(p.numel() for p in stock.parameters()) - compressed_params
    assert "total" in str(report)
    _check_against_reference(model, ref)
    with torch.no_grad():
        got = model(dense, sparse)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    stock.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(stock(dense, sparse), got, rtol=0, atol=0)


def test_after_rank_truncation() -> None:
    model = _dlrm(dcn=True)
    dense, sparse = _inputs()
    compress(model, POLICY)
    ebc = model.sparse_arch.embedding_bag_collection
    layer = next(m for m in model.modules() if isinstance(m, TTLinear))
    with torch.no_grad():
        ebc.groups[0].controllers[0][:, 1:] = 0.0  # every table of the group keeps rank 1 on bond 0
        layer.controllers[0][1:] = 0.0
    before = (list(ebc.groups[0].ranks), list(layer.ranks))
    assert ebc.groups[0].truncate_ranks(1e-3) and layer.truncate_ranks(1e-3)
    assert ebc.groups[0].ranks[0] == 1 and layer.ranks[0] == 1 and (ebc.groups[0].ranks, layer.ranks) != before
    with torch.no_grad():
        expected = model(dense, sparse)
    ref = _reference(model)

    decompress(model)

    _check_against_reference(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(model(dense, sparse), expected, rtol=1e-5, atol=1e-5)
    stock = _dlrm(dcn=True, seed=1)
    stock.load_state_dict(model.state_dict(), strict=True)


def test_trainer_model_with_fused_relu_and_narrow_layers() -> None:
    # the trainer's own compressed model: tt_mlp fuses the ReLU into TTLinear and the bottom
    # MLP's first layer is a NarrowLinear; decompressed it must load into TorchRec's DLRM
    from comera_rec.dlrm.model import criteo_tables, make_dlrm

    tables = criteo_tables([400, 300, 20], 8, ["f0", "f1", "f2"])
    torch.manual_seed(0)
    policy = CompressionPolicy(rank=3, min_rows_to_compress=100, min_params_to_compress=0, min_gain=3.0)
    model = make_dlrm(tables, dense_in_features=6, bottom_mlp=[64, 8], top_mlp=[64, 1], policy=policy)
    assert any(isinstance(m, TTLinear) and m.relu for m in model.modules())
    assert any(isinstance(m, NarrowLinear) for m in model.modules())
    dense, sparse = _inputs()
    with torch.no_grad():
        expected = model(dense, sparse)

    report = decompress(model)

    assert not any(isinstance(m, (TTLinear, NarrowLinear)) for m in model.modules())
    assert all(p._activation_fn is torch.relu for p in model.dense_arch.model._mlp)
    assert {m.kind for m in report.modules} == {"EmbeddingBagCollection", "Linear"}
    stock = make_dlrm(
        criteo_tables([400, 300, 20], 8, ["f0", "f1", "f2"]), dense_in_features=6, bottom_mlp=[64, 8], top_mlp=[64, 1]
    )
    stock.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(stock(dense, sparse), expected, rtol=1e-5, atol=1e-5)


def test_standalone_layers() -> None:
    from comera_rec.tensor.embedding import TTMEmbeddingBag

    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": TTLinear(24, 12, rank=3, relu=True), "bag": TTMEmbeddingBag(500, 8, rank=3)})
    x, ids, offsets = torch.randn(5, 24), torch.tensor([1, 499, 7, 7]), torch.tensor([0, 3, 4])
    with torch.no_grad():
        expected = model["lin"](x), model["bag"](ids, offsets)
    weight = _tt_linear_weight(model["lin"])
    report = comera_rec.decompress(model)  # the lazy top-level name
    assert [(m.name, m.kind) for m in report.modules] == [("lin", "NarrowLinear"), ("bag", "EmbeddingBag")]
    assert model["lin"].relu  # no perceptron to take the ReLU: the layer keeps it
    torch.testing.assert_close(model["lin"].weight.double(), weight, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(model["lin"](x), expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model["bag"](ids, offsets), expected[1], rtol=1e-5, atol=1e-5)


def test_nothing_compressed_gives_an_empty_report() -> None:
    model = _dlrm(dcn=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = decompress(model)
    assert report.modules == [] and report.params_before == report.params_after == 0
    assert type(model.sparse_arch.embedding_bag_collection) is EmbeddingBagCollection
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)


def test_bad_input_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="nn.Module, got dict"):
        decompress({"weight": torch.zeros(2)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="itself a TTLinear"):
        decompress(TTLinear(16, 8, rank=2))
