"""comera_rec.dlrm.serving_ops and export_dlrm(kernels=True): the fused CPU kernels as
``torch.ops.comera_rec`` operators equal references computed another way (float64 products,
the plain-PyTorch inference form, the eager model), trace with dynamic batch sizes, name bad
input, and a program calling them runs in an interpreter that imports torch only."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_rec.dlrm.export import (
    ExportError,
    ServingLookup,
    calls_operators,
    export_dlrm,
    kjt_inputs,
    load_exported,
    save_exported,
    serving_model,
)
from comera_rec.dlrm.export_layers import ServingPairwiseDot
from comera_rec.dlrm.model import build_dlrm
from comera_rec.dlrm.serving_ops import HALVES_PAD_BYTES, LIBRARY, operator_library, operators_loaded
from comera_rec.rank.truncation import truncate_model
from comera_rec.tensor import kernels
from comera_rec.tensor.train import tensor_train_modules
from tests.dlrm.test_export import TINY, TOL, batches, check_equal, mixed_collection


@pytest.fixture(scope="module", autouse=True)
def library() -> Path:
    # built at set-up (make); a failed build fails these tests instead of skipping them
    path = operator_library()
    assert path is not None, f"the operator library did not build: {LIBRARY.error}"
    return path


def tt_dlrm(**changes: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_dlrm(replace(TINY, **{"compressed": True, "fused_interaction": True, **changes})).eval()


# ------------------------------------------------------------------------------ operators


@given(
    rows=st.integers(0, 9),
    n_in=st.integers(1, 40),
    n_out=st.integers(1, 40),
    rank=st.integers(1, 20),
    relu=st.booleans(),
    bias=st.booleans(),
)
def test_tt_linear_equals_float64_products(rows: int, n_in: int, n_out: int, rank: int, relu: bool, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n_in * 40 + n_out)
    x, left, right = (torch.randn(*s, generator=g) for s in ((rows, n_in), (n_in, rank), (rank, n_out)))
    b = torch.randn(n_out, generator=g) if bias else None
    y = torch.ops.comera_rec.tt_linear(x, left, right, b, relu)
    want = x.double() @ left.double() @ right.double() + (b.double() if bias else 0)
    want = want.clamp_min(0) if relu else want
    assert y.shape == (rows, n_out) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pairwise_dots_equal_the_plain_form(dtype: torch.dtype) -> None:
    dense, sparse = torch.randn(6, 8, dtype=dtype), torch.randn(6, 5, 8, dtype=dtype)
    want = ServingPairwiseDot(5)(dense.double(), sparse.double())
    got = torch.ops.comera_rec.pairwise_dots(dense, sparse.transpose(0, 1).contiguous().transpose(0, 1))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_cross_net_operator_equals_the_plain_form() -> None:
    from comera_rec.dlrm.export_layers import ServingCrossNet
    from comera_rec.integration.mlp import TTLowRankCrossNet

    torch.manual_seed(0)
    net = TTLowRankCrossNet(24, num_layers=3, low_rank=8, tt_rank=3, min_gain=0.0)
    with torch.no_grad():
        for b in net.bias:
            b.normal_()
    plain, fused = ServingCrossNet(net), ServingCrossNet(net, kernels=True)
    x = torch.randn(50, 24)  # more rows than one block (block_rows)
    assert x.shape[0] > fused.block_rows
    with torch.no_grad():
        want = net.forward_layers(x)
        torch.testing.assert_close(plain(x), want, **TOL)
        torch.testing.assert_close(fused(x), want, **TOL)
        # the input as column blocks, never joined
        torch.testing.assert_close(fused.forward_blocks([x[:, :5], x[:, 5:]]), want, **TOL)
        # a few rows: plain products, not the packed kernel
        torch.testing.assert_close(fused.forward_blocks([x[:3, :5], x[:3, 5:]]), want[:3], **TOL)
    assert torch.ops.comera_rec.tt_cross([x[:2].to("meta"), x[:2, :3].to("meta")], [], [], [], 4).shape == (2, 27)


def test_cross_net_and_mlp_operator_equals_the_plain_form() -> None:
    from comera_rec.dlrm.export_layers import ServingCrossNet, ServingTTLinear
    from comera_rec.integration.mlp import TTLowRankCrossNet
    from comera_rec.tensor.linear import TTLinear

    torch.manual_seed(0)
    net = TTLowRankCrossNet(24, num_layers=2, low_rank=8, tt_rank=3, min_gain=0.0)
    top = [TTLinear(24, 20, rank=3, relu=True), TTLinear(20, 12, rank=2, bias=False), TTLinear(12, 6, rank=4)]
    plain, fused = ServingCrossNet(net), ServingCrossNet(net, kernels=True)
    plain.next_layers.extend(ServingTTLinear(layer) for layer in top)
    fused.next_layers.extend(ServingTTLinear(layer, kernels=True) for layer in top)
    x = torch.randn(50, 24)  # more rows than one block
    with torch.no_grad():
        want = net.forward_layers(x)
        for layer in top:
            want = layer(want)
        torch.testing.assert_close(plain(x), want, **TOL)
        torch.testing.assert_close(fused(x), want, **TOL)
        torch.testing.assert_close(fused.forward_blocks([x[:, :5], x[:, 5:]]), want, **TOL)
        # a few rows: plain products, not the packed kernel
        torch.testing.assert_close(fused.forward_blocks([x[:3, :5], x[:3, 5:]]), want[:3], **TOL)
    ops = torch.ops.comera_rec
    after = list(fused.next_layers)
    mlp = [[m.left for m in after], [m.right for m in after], [after[0].right.new_empty(0)] * 3, [True, False, False]]
    meta = [x[:2, :5].to("meta"), x[:2, 5:].to("meta")]
    assert ops.tt_cross_mlp(meta, [], [], [], 4, *mlp).shape == (2, 6)
    layers = [list(fused.lefts), list(fused.rights), list(fused.biases)]
    with pytest.raises(RuntimeError, match="left has 23 rows for 24 input features"):
        ops.tt_cross_mlp([x], *layers, 4, [after[0].left[:23]], [after[0].right], [after[0].bias], [True])
    with pytest.raises(RuntimeError, match="no MLP layers"):
        ops.tt_cross_mlp([x], *layers, 4, [], [], [], [])


def test_meta_kernels_give_the_shapes_of_any_batch() -> None:
    # what torch.export traces with: no data, the batch a symbol
    ops = torch.ops.comera_rec
    x, left, right = torch.empty(7, 12, device="meta"), torch.empty(12, 3, device="meta"), torch.empty(3, 5)
    assert ops.tt_linear(x, left, right.to("meta"), None, True).shape == (7, 5)
    assert ops.pairwise_dots(torch.empty(4, 8, device="meta"), torch.empty(4, 3, 8, device="meta")).shape == (4, 8 + 6)
    meta = {"dtype": torch.long, "device": "meta"}
    out = ops.ttm_halves_bags(torch.empty(0, **meta), torch.empty(11, **meta), torch.empty(9, 8, device="meta"),
                              torch.empty(2, **meta), torch.empty(2, **meta), [], [], torch.empty(0, 2, **meta),
                              [], [])  # fmt: skip
    assert out.shape == (5, 2, 8)  # the F B = 10 bags sample-major


@pytest.mark.parametrize("mean", [False, True])
def test_lookup_with_the_operator_equals_the_plain_form(mean: bool) -> None:
    # TT features in two stacks and dense ones, in an order unlike the collection's; sum and
    # mean pooling, empty bags included (lengths of 0); rank 3, padded to whole 64-byte
    # vectors in the kernels' halves
    from tests.integration.helpers import kjt

    ebc = mixed_collection(mean, rank=3)
    order = ["f3", "f1", "f0", "f2"]
    plain, fused = ServingLookup(order, ebc, "ebc"), ServingLookup(order, ebc, "ebc", kernels=True)
    assert len(fused.groups) == 0 and len(fused.kernel_lefts) == len(ebc.groups)
    lanes = HALVES_PAD_BYTES // 4
    assert all(p.shape[-1] % lanes == 0 for p in (*fused.kernel_lefts, *fused.kernel_rights))
    features = kjt(batch=6, seed=2)
    values, lengths = kjt_inputs(features, order)
    assert (lengths == 0).any()  # empty bags in the batch
    with torch.no_grad():
        want = ebc(features).to_dict()
        got = fused(values, lengths)
        torch.testing.assert_close(got, plain(values, lengths), **TOL)
    for i, name in enumerate(order):
        torch.testing.assert_close(got[:, i], want[name], **TOL)
    # only TT features read: no uncompressed bags to start from
    only_tt = ["f2", "f3", "f1"]
    lookup = ServingLookup(only_tt, ebc, "ebc", kernels=True)
    assert not lookup.has_dense
    with torch.no_grad():
        got = lookup(*kjt_inputs(features, only_tt))
    for i, name in enumerate(only_tt):
        torch.testing.assert_close(got[:, i], want[name], **TOL)


def test_bad_lookup_input_is_named() -> None:
    left, right = torch.randn(2 * 3, 2, 16), torch.randn(2 * 4, 2, 16)  # 2 tables, N_l 3, N_r 4
    offsets = torch.tensor([0, 1, 2, 3, 4])  # F = 2 features, B = 2, one id a bag
    weight = torch.randn(10, 4)  # the uncompressed tables: rows 6-9 feature 0's table
    first, rows = torch.tensor([-1, -1]), torch.tensor([0, 0])  # no feature reads them
    tables = torch.tensor([[0, 1]])

    def call(ids, tables=tables, lefts=(left,), rights=(right,), first=first, rows=rows):
        n = len(lefts)
        return torch.ops.comera_rec.ttm_halves_bags(
            torch.tensor(ids), offsets, weight, first, rows, list(lefts), list(rights), tables, [3] * n, [4] * n
        )

    with pytest.raises(RuntimeError, match=r"id 12 out of range \[0, 12\)"):
        call([0, 12, 1, 2])
    with pytest.raises(RuntimeError, match="reads table 2 of a stack of 2"):
        call([0, 1, 1, 2], tables=torch.tensor([[0, 2]]))
    with pytest.raises(RuntimeError, match="not a whole number"):
        call([0, 1, 1, 2], lefts=(left[..., :3].contiguous(),), rights=(right[..., :3].contiguous(),))
    with pytest.raises(RuntimeError, match="not whole rows of 3 features"):
        call([0, 1, 1, 2], tables=torch.tensor([[0, 1, -1]]))
    with pytest.raises(RuntimeError, match="feature 1 is read by stacks 0 and 1"):
        call([0, 1, 1, 2], tables=torch.tensor([[0, 1], [-1, 0]]), lefts=(left, left), rights=(right, right))
    with pytest.raises(RuntimeError, match="feature 0 is read by no table"):
        call([0, 1, 1, 2], tables=torch.tensor([[-1, 1]]))
    dense = {"first": torch.tensor([6, -1]), "rows": torch.tensor([4, 0])}
    with pytest.raises(RuntimeError, match="feature 0 is read by stack 0 and a dense table"):
        call([0, 1, 1, 2], **dense)
    with pytest.raises(RuntimeError, match=r"feature 0's id 4 out of range \[0, 4\) of its table"):
        call([4, 1, 1, 2], tables=torch.tensor([[-1, 1]]), **dense)
    with pytest.raises(RuntimeError, match=r"feature 0's rows \[6, 11\) outside the 10 rows"):
        call([0, 1, 1, 2], tables=torch.tensor([[-1, 1]]), first=torch.tensor([6, -1]), rows=torch.tensor([5, 0]))
    # (B, F, D): feature 0's bags rows of the uncompressed table, feature 1's the products of
    # the halves' rows of its table
    out = call([3, 0, 0, 7], tables=torch.tensor([[-1, 1]]), **dense)
    assert out.shape == (2, 2, 4)
    torch.testing.assert_close(out[:, 0], weight[[9, 6]])
    for b, i in ((0, 0), (1, 7)):  # feature 1 reads table 1: prefix 3 + i // 4, suffix 4 + i % 4
        p, s = left[3 + i // 4], right[4 + i % 4]
        torch.testing.assert_close(out[b, 1], (p.double() @ s.double().t()).flatten()[:4].float(), **TOL)


# ------------------------------------------------------------------------------ programs


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"fused_interaction": False},
        {"fused_interaction": False, "interaction": "dcn", "dcn_num_layers": 2, "dcn_low_rank": 16},
    ],
    ids=["tt_fused", "tt", "tt_dcn"],
)
def test_program_with_the_operators_equals_eager(changes: dict) -> None:
    model = tt_dlrm(**changes)
    program = export_dlrm(model, kernels=True)
    check_equal(model, program.module(), serving_model(model).feature_names)
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "comera_rec.ttm_halves_bags.default" in ops and "comera_rec.tt_linear.default" in ops
    assert ("comera_rec.pairwise_dots.default" in ops) == (not changes)  # the fused interaction's kernel
    # a DCN's cross net and its top MLP's TT layers: one call
    assert ("comera_rec.tt_cross_mlp.default" in ops) == (changes.get("interaction") == "dcn")
    assert "comera_rec.tt_cross.default" not in ops
    assert "aten._unique2.default" not in ops  # the ids are de-duplicated inside the operator


def test_program_with_the_operators_after_rank_truncation() -> None:
    model = tt_dlrm()
    with torch.no_grad():
        for _, module in tensor_train_modules(model):
            for d in module.controllers:
                d[..., (d.shape[-1] + 1) // 2 :] = 0.0
    assert truncate_model(model, 1e-6).changed
    check_equal(model, export_dlrm(model, kernels=True).module(), serving_model(model).feature_names)


_TORCH_ONLY = """
import sys, torch
try:
    torch.export.load(sys.argv[1])
    raise SystemExit("loaded without the operator library")
except RuntimeError:  # its operators are not registered (the log names them)
    pass
torch.ops.load_library(sys.argv[4])
program = torch.export.load(sys.argv[1]).module()
with torch.no_grad():
    torch.save(program(*torch.load(sys.argv[2])), sys.argv[3])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("comera_rec", "torchrec", "fbgemm_gpu"))
assert not loaded, loaded
"""


def test_program_runs_with_torch_and_the_library_only(tmp_path: Path, library: Path) -> None:
    model = tt_dlrm()
    names = serving_model(model).feature_names
    path = save_exported(export_dlrm(model, kernels=True), tmp_path / "model.pt2")
    batch = batches(16)[0]
    inputs = (batch.dense_features, *kjt_inputs(batch.sparse_features, names))
    torch.save(inputs, tmp_path / "inputs.pt")
    script = tmp_path / "serve.py"
    script.write_text(_TORCH_ONLY)
    subprocess.run(
        [sys.executable, str(script), str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"), str(library)],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    with torch.no_grad():
        eager = model(batch.dense_features, batch.sparse_features)
        torch.testing.assert_close(torch.load(tmp_path / "out.pt"), eager, **TOL)
        # comera-rec's own loader: the library is loaded in this process, the program runs
        torch.testing.assert_close(load_exported(path)(*inputs), eager, **TOL)
    assert operators_loaded()
    # and in a fresh process, where nothing loaded the library yet
    fresh = (
        "import sys, torch; from comera_rec.dlrm.export import load_exported; "
        "out = load_exported(sys.argv[1])(*torch.load(sys.argv[2])); torch.save(out, sys.argv[3])"
    )
    subprocess.run(
        [sys.executable, "-c", fresh, str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "fresh.pt")],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    torch.testing.assert_close(torch.load(tmp_path / "fresh.pt"), eager, **TOL)
    assert calls_operators(path)
    assert not calls_operators(save_exported(export_dlrm(model), tmp_path / "plain.pt2"))
    with pytest.raises(ValueError, match="not a saved program"):
        calls_operators(script)


def test_kernels_switched_off_is_a_named_error() -> None:
    model = tt_dlrm()
    kernels.set_cpu_kernel_enabled(False)
    try:
        with pytest.raises(ExportError, match=r"kernels=True: the operator library torch.ops.comera_rec"):
            serving_model(model, kernels=True)
    finally:
        kernels.set_cpu_kernel_enabled(True)
