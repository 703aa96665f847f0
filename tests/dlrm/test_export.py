"""comera_rec.dlrm.export: the exported inference form of dense and compressed DLRMs gives
the eager model's logits, saves and loads, and names the part that cannot export."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.export import (
    ExportError,
    ServingLookup,
    export_dlrm,
    kjt_inputs,
    load_exported,
    save_exported,
    serving_model,
)
from comera_rec.dlrm.model import build_dlrm
from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.rank.truncation import truncate_model
from comera_rec.tensor.linear import TTLinear
from comera_rec.tensor.train import tensor_train_modules
from tests.dlrm.tiny import TABLE_SIZES

TINY = DLRMConfig(
    table_sizes=list(TABLE_SIZES),
    embedding_dim=8,
    bottom_mlp=[64, 32, 8],
    top_mlp=[64, 32, 1],
    rank=4,
    mlp_rank=4,
    min_rows_to_compress=10_000,
    min_params_to_compress=0,
)
# exported and eager sum in other orders (kernels vs ATen): equal up to float rounding
TOL = {"rtol": 1e-5, "atol": 1e-6}


def batches(batch_size: int, count: int = 2) -> list:
    """Synthetic Criteo batches with Zipf ids over the tiny tables."""
    data = SyntheticCriteo(
        SyntheticCriteoConfig(
            num_embeddings_per_feature=list(TABLE_SIZES),
            zipf_exponent=1.1,
            batch_size=batch_size,
            num_rows=batch_size * count,
            seed=3,
            stream="val",
        )
    )
    return list(data)


def check_equal(model: nn.Module, program_module: nn.Module, feature_names: list[str]) -> None:
    """Exported and eager logits agree on batches of 64 and of 1 row."""
    for batch in batches(64) + batches(1):
        values, lengths = kjt_inputs(batch.sparse_features, feature_names)
        with torch.no_grad():
            eager = model(batch.dense_features, batch.sparse_features)
            exported = program_module(batch.dense_features, values, lengths)
        assert exported.shape == eager.shape
        torch.testing.assert_close(exported, eager, **TOL)


@pytest.mark.parametrize(
    "config",
    [
        replace(TINY, compressed=True, fused_interaction=True),
        replace(TINY, compressed=True, fused_interaction=False),
        replace(TINY, compressed=False),
        replace(TINY, compressed=True, interaction="dcn", dcn_num_layers=2, dcn_low_rank=16),
    ],
    ids=["tt_fused", "tt", "dense", "tt_dcn"],
)
def test_exported_equals_eager(config: DLRMConfig) -> None:
    model = build_dlrm(config).eval()
    program = export_dlrm(model)
    serving = serving_model(model)
    check_equal(model, program.module(), serving.feature_names)
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    names = list(program.state_dict) + list(program.constants)
    # no rank controller survives as a tensor of the program: folded into cores / chains
    assert not any("controllers" in n for n in names)
    if config.compressed:
        assert "aten._unique2.default" in ops  # the de-duplicated TTM lookup is in the graph
        assert isinstance(model.sparse_arch.embedding_bag_collection, TTMEmbeddingBagCollection)


def test_after_rank_truncation() -> None:
    model = build_dlrm(replace(TINY, compressed=True, fused_interaction=True)).eval()
    with torch.no_grad():
        for _, module in tensor_train_modules(model):
            for d in module.controllers:  # the upper half of every bond dead, the rest scaled
                r = d.shape[-1]
                d[..., (r + 1) // 2 :] = 0.0
                d[..., : (r + 1) // 2] = 0.7
    result = truncate_model(model, 1e-6)
    assert result.changed and result.ranks_after != result.ranks_before
    program = export_dlrm(model)
    check_equal(model, program.module(), serving_model(model).feature_names)


@pytest.mark.parametrize("compressed", [True, False], ids=["tt", "dense"])
def test_save_load_round_trip(tmp_path: Path, compressed: bool) -> None:
    model = build_dlrm(replace(TINY, compressed=compressed, fused_interaction=compressed)).eval()
    names = serving_model(model).feature_names
    path = save_exported(export_dlrm(model), tmp_path / "sub" / "model.pt2")
    assert path.is_file() and path.stat().st_size > 0
    loaded = load_exported(path)
    assert isinstance(torch.export.load(str(path)), torch.export.ExportedProgram)
    check_equal(model, loaded, names)
    # keys in another order than the model's: kjt_inputs puts them back
    batch = batches(8)[0]
    kjt = batch.sparse_features
    shuffled = kjt.permute(list(reversed(range(len(kjt.keys())))))
    with torch.no_grad():
        a = loaded(batch.dense_features, *kjt_inputs(kjt, names))
        b = loaded(batch.dense_features, *kjt_inputs(shuffled, names))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


_PLAIN_TORCH = """
import sys, torch
program = torch.export.load(sys.argv[1]).module()
inputs = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(program(*inputs), sys.argv[3])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("comera_rec", "torchrec", "fbgemm_gpu"))
assert not loaded, loaded
"""


def test_program_runs_without_the_training_code(tmp_path: Path) -> None:
    """A fresh interpreter that imports only torch loads and runs the compressed program."""
    model = build_dlrm(replace(TINY, compressed=True, fused_interaction=True)).eval()
    names = serving_model(model).feature_names
    path = save_exported(export_dlrm(model), tmp_path / "model.pt2")
    batch = batches(16)[0]
    inputs = (batch.dense_features, *kjt_inputs(batch.sparse_features, names))
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "serve.py"
    script.write_text(_PLAIN_TORCH)
    subprocess.run(
        [sys.executable, str(script), str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
        check=True,
        cwd=tmp_path,  # not the checkout: nothing of the project on the path but the install
        timeout=300,
    )
    with torch.no_grad():
        eager = model(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), eager, **TOL)


class _BranchOnData(nn.Module):
    """A top MLP that branches in Python on its input's values: not exportable."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 0):
            return self.inner(x)
        return -self.inner(x)


def test_unexportable_part_is_named() -> None:
    model = build_dlrm(replace(TINY, compressed=True, fused_interaction=True)).eval()
    model.over_arch = _BranchOnData(model.over_arch)
    with pytest.raises(ExportError, match=r"over_arch \(_BranchOnData\) does not export"):
        export_dlrm(model)


def test_parts_without_inference_form_are_named() -> None:
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    weighted = EmbeddingBagCollection(tables, is_weighted=True)
    with pytest.raises(ExportError, match=r"sparse_arch.embedding_bag_collection \(EmbeddingBagCollection\): weighted"):
        ServingLookup(["f"], weighted, "sparse_arch.embedding_bag_collection")
    with pytest.raises(ExportError, match=r"model \(Linear\)"):
        serving_model(nn.Linear(2, 2))


def mixed_collection(mean: bool, rank: int = 4) -> TTMEmbeddingBagCollection:
    """Tables a and b (other row shapes, the same (M_l, r) and (r, M_r) blocks), d (other
    blocks: a stack of its own) compressed, c dense; a and c mean-pooled where ``mean``.
    Features f1, f2, f0, f3 (as ``tests.integration.helpers.kjt`` draws them)."""
    from torchrec.modules.embedding_configs import PoolingType

    from comera_rec.integration import CompressionPolicy, TableOverride

    pooling = PoolingType.MEAN if mean else PoolingType.SUM
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f1"], pooling=pooling),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=90, feature_names=["f2"]),
        EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=10, feature_names=["f0"], pooling=pooling),
        EmbeddingBagConfig(name="d", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
    ]
    policy = CompressionPolicy(
        rank=rank,
        min_rows_to_compress=50,
        min_params_to_compress=0,
        min_gain=0.0,
        per_table={
            "a": TableOverride(shape=((10, 10), (2, 4))),
            "b": TableOverride(shape=((9, 10), (2, 4))),
            "d": TableOverride(shape=((5, 6, 10), (2, 2, 2))),
        },
    )
    torch.manual_seed(0)
    return TTMEmbeddingBagCollection(tables, policy).eval()


@pytest.mark.parametrize("mean", [False, True])
def test_stacks_with_one_row_block_shape_share_a_lookup(mean: bool) -> None:
    # a and b: one concatenated lookup; d: a lookup of its own; c: dense. The same pooled
    # bags as the collection, with features of every kind in one batch and in any order
    from tests.integration.helpers import kjt

    ebc = mixed_collection(mean)
    assert len(ebc.groups) == 3 and ebc.dense_tables() == ["c"]
    order = ["f3", "f1", "f0", "f2"]
    lookup = ServingLookup(order, ebc, "ebc")
    assert len(lookup.groups) == 2  # a and b together, d alone
    features = kjt(batch=5, seed=1)
    values, lengths = kjt_inputs(features, order)
    with torch.no_grad():
        want = ebc(features).to_dict()
        got = lookup(values, lengths)  # (B, F, D)
    for i, name in enumerate(order):
        torch.testing.assert_close(got[:, i], want[name], **TOL)


def test_a_tt_cross_net_exports_with_its_projections_merged() -> None:
    from comera_rec.dlrm.export import ServingCrossNet

    config = replace(TINY, compressed=True, interaction="dcn", dcn_num_layers=2, dcn_low_rank=16)
    model = build_dlrm(config).eval()
    crossnet = model.inter_arch.crossnet
    assert all(isinstance(p, TTLinear) for p in (*crossnet.V, *crossnet.W))
    serving = serving_model(model)
    merged = serving.inter_arch.crossnet
    assert isinstance(merged, ServingCrossNet)
    x = torch.randn(5, crossnet.in_features)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), crossnet(x), **TOL)
    # one (N, r) and one (r, N) weight a layer: no low_rank-wide intermediate left
    assert [tuple(p.shape) for p in merged.lefts] == [(crossnet.in_features, p.shape[0]) for p in merged.rights]


@pytest.mark.parametrize("relu, bias", [(True, True), (True, False), (False, True)])
def test_serving_layers_equal_float64_and_fuse_the_relu(relu: bool, bias: bool) -> None:
    """The TT and narrow layers' inference forms equal a float64 reference; with a bias and a
    ReLU each is one ``aten._addmm_activation`` in the exported graph (no ReLU of its own)."""
    from comera_rec.dlrm.export_layers import ServingLinear, ServingTTLinear
    from comera_rec.tensor.linear import NarrowLinear

    torch.manual_seed(0)
    tt = TTLinear(48, 30, rank=4, bias=bias, relu=relu)
    narrow = NarrowLinear(5, 30, relu=relu, bias=bias) if bias else None
    x = torch.randn(7, 48)
    for layer, form, inp in ((tt, ServingTTLinear(tt), x), (narrow, None, torch.randn(7, 5))):
        if layer is None:
            continue
        form = form if form is not None else ServingLinear(layer, relu=relu)
        w = layer.dense_weight().double() if isinstance(layer, TTLinear) else layer.weight.double()
        ref = inp.double() @ w.t() + (layer.bias.double() if bias else 0)
        ref = torch.relu(ref) if relu else ref
        torch.testing.assert_close(form(inp).double(), ref, rtol=1e-5, atol=1e-5)
        program = torch.export.export(form, (inp,), dynamic_shapes=({0: torch.export.Dim("B")},))
        ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        fused = relu and bias
        assert ("aten._addmm_activation.default" in ops) == fused, ops
        assert ("aten.relu.default" in ops) == (relu and not fused), ops
        torch.testing.assert_close(program.module()(inp), form(inp), rtol=0, atol=0)


def test_the_top_mlps_tt_layers_move_into_the_cross_net_with_kernels() -> None:
    from torch import nn

    from comera_rec.dlrm.export_layers import ServingTTLinear, fuse_cross_net_and_top_mlp, serving_dense_part

    config = replace(TINY, compressed=True, interaction="dcn", dcn_num_layers=2, dcn_low_rank=16)
    model = build_dlrm(config).eval()
    perceptrons = list(model.over_arch.model[0]._mlp)
    assert [type(p._linear) for p in perceptrons] == [TTLinear, TTLinear]
    # without kernels: the parts stay as they are
    assert len(serving_model(model).inter_arch.crossnet.next_layers) == 0
    plain_inter = serving_dense_part(model.inter_arch, "inter_arch")
    plain_over = serving_dense_part(model.over_arch, "over_arch")
    assert fuse_cross_net_and_top_mlp(plain_inter, plain_over) == 0
    # with kernels (the parts' forms; calling them needs the operator library)
    inter = serving_dense_part(model.inter_arch, "inter_arch", kernels=True)
    over = serving_dense_part(model.over_arch, "over_arch", kernels=True)
    assert fuse_cross_net_and_top_mlp(inter, over) == 2
    moved = list(inter.crossnet.next_layers)
    assert all(isinstance(m, ServingTTLinear) and m.kernels for m in moved)
    assert [m.right.shape[1] for m in moved] == [64, 32]  # in the top MLP's order
    assert all(isinstance(p._linear, nn.Identity) for p in over.model[0]._mlp)
    assert isinstance(over.model[1], nn.Linear)  # the last layer stays
    assert isinstance(model.over_arch.model[0]._mlp[0]._linear, TTLinear)  # the trained model is left as it was
    assert fuse_cross_net_and_top_mlp(inter, over) == 0  # once only
    # a layer that is not TT ends the run: the ones after it stay where they are
    over = serving_dense_part(model.over_arch, "over_arch", kernels=True)
    over.model[0]._mlp[1]._activation_fn = nn.ReLU()
    inter = serving_dense_part(model.inter_arch, "inter_arch", kernels=True)
    assert fuse_cross_net_and_top_mlp(inter, over) == 1
    assert isinstance(over.model[0]._mlp[1]._linear, ServingTTLinear)
    # a dot interaction has no cross net to take them
    dot = build_dlrm(replace(TINY, compressed=True)).eval()
    over_dot = serving_dense_part(dot.over_arch, "over_arch", kernels=True)
    assert fuse_cross_net_and_top_mlp(serving_dense_part(dot.inter_arch, "inter_arch", kernels=True), over_dot) == 0
    assert isinstance(over_dot.model[0]._mlp[0]._linear, ServingTTLinear)
