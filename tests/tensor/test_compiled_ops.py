"""The fused CPU TT-layer kernels as ``torch.library`` operators (``compiled_ops``): each
passes ``torch.library.opcheck`` (schema, fake shapes and strides against the real outputs,
autograd registration, AOT dispatch), gives the eager kernels' values and gradients bit for
bit, and is what a compiled TT layer calls, in one graph with the eager layer's values."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from comera_rec.tensor import TTLinear, kernels
from comera_rec.tensor.kernels import compiled_ops
from tests.tensor.test_tt_chain_kernel import inputs_of, make_chain

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


def grads_of(y: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return torch.autograd.grad(y, inputs, torch.randn(y.shape, generator=g, dtype=y.dtype))


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ranks off and on whole vectors (the kernels pad the rank to whole vectors: 8 / 16 float32,
# 4 / 8 float64), bias or not, ReLU or not
CASES = [(3, True, True), (16, False, False), (5, True, False), (17, False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank,bias,relu", CASES)
def test_tt_linear_operator_passes_opcheck_and_equals_the_kernel(dtype, rank, bias, relu) -> None:
    x, layers = make_chain(13, [20, 24], [rank], [relu], biases=[bias], dtype=dtype)
    left, right, b, _ = layers[0]
    operands = [x, left, right, b if b is not None else x.new_empty(0), relu]
    torch.library.opcheck(compiled_ops.tt_linear_op, operands)
    inputs = inputs_of(x, layers)
    want = kernels.tt_linear_cpu(x, left, right, b, relu)
    got = compiled_ops.tt_linear_compiled(x, left, right, b, relu)
    assert_same(got, want)
    for g, w in zip(grads_of(got, inputs), grads_of(want, inputs)):
        assert_same(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tt_chain_operator_passes_opcheck_and_equals_the_kernel(dtype) -> None:
    x, layers = make_chain(29, [12, 20, 9, 7], [3, 16, 5], [True, False, True], biases=[True, False, True], dtype=dtype)
    lefts, rights = [layer[0] for layer in layers], [layer[1] for layer in layers]
    biases = [layer[2] if layer[2] is not None else x.new_empty(0) for layer in layers]
    torch.library.opcheck(compiled_ops.tt_chain_op, [x, lefts, rights, biases, [layer[3] for layer in layers]])
    inputs = inputs_of(x, layers)
    want = kernels.tt_chain_cpu(x, layers)
    got = compiled_ops.tt_chain_compiled(x, layers)
    assert_same(got, want)
    for g, w in zip(grads_of(got, inputs), grads_of(want, inputs)):
        assert_same(g, w)


def test_gradients_not_asked_for_are_none() -> None:
    x, layers = make_chain(6, [8, 10, 4], [3, 2], [True, False])
    x.requires_grad_(False)
    layers[0][0].requires_grad_(False)  # the first layer's left
    y = compiled_ops.tt_chain_compiled(x, layers)
    y.sum().backward()
    assert layers[0][0].grad is None
    assert all(t.grad is not None for t in (layers[0][1], layers[0][2], layers[1][0], layers[1][1], layers[1][2]))


def tt_weight(in_shape, out_shape, rank, seed=0, dtype=torch.float64):
    """A TT layer's cores and controllers (as ``TTLinear.train_tensors``), needing gradients."""
    g = torch.Generator().manual_seed(seed)
    shapes = list(in_shape) + list(out_shape)
    d = len(in_shape)
    ranks = [1] + [rank] * (2 * d - 1) + [1]
    cores = [
        torch.randn(ranks[k], n, ranks[k + 1], generator=g, dtype=dtype).requires_grad_() for k, n in enumerate(shapes)
    ]
    controllers = [(torch.rand(rank, generator=g, dtype=dtype) + 0.5).requires_grad_() for _ in range(2 * d - 1)]
    return cores, controllers


@settings(max_examples=12, deadline=None)
@given(
    in_shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
    rank=st.integers(1, 5),
)
def test_tt_chains_operator_fake_shapes_match_the_kernel(in_shape, data, rank) -> None:
    out_shape = data.draw(st.lists(st.integers(1, 4), min_size=len(in_shape), max_size=len(in_shape)))
    cores, controllers = tt_weight(in_shape, out_shape, rank)
    d = len(in_shape)
    in_features = data.draw(st.integers(1, int(torch.tensor(in_shape).prod())))
    out_features = data.draw(st.integers(1, int(torch.tensor(out_shape).prod())))
    real = compiled_ops.tt_chains_op(cores, controllers, d, in_features, out_features)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = compiled_ops.tt_chains_op(
            [mode.from_tensor(c) for c in cores],
            [mode.from_tensor(c) for c in controllers],
            d,
            in_features,
            out_features,
        )
    assert [(t.shape, t.stride()) for t in fake] == [(t.shape, t.stride()) for t in real]


def test_tt_chains_operator_passes_opcheck_and_equals_the_kernel() -> None:
    cores, controllers = tt_weight([3, 4], [2, 5], rank=3)
    torch.library.opcheck(compiled_ops.tt_chains_op, [cores, controllers, 2, 10, 9])
    want = kernels.tt_chains_cpu(cores[:2], cores[2:], controllers, 10, 9)
    got = compiled_ops.tt_chains_compiled(cores, controllers, 2, 10, 9)
    for g, w in zip(got, want):
        assert_same(g, w)
    inputs = cores + controllers
    loss_of = lambda lr: (lr[0] @ lr[1] * torch.arange(90.0, dtype=torch.float64).reshape(10, 9)).sum()  # noqa: E731
    for g, w in zip(torch.autograd.grad(loss_of(got), inputs), torch.autograd.grad(loss_of(want), inputs)):
        assert_same(g, w)


def graph_targets(model: torch.nn.Module, *args: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    """``model(*args)`` compiled (AOT autograd, no C++ compile), and the names of the
    operators in its forward and backward graphs."""
    names: set[str] = set()

    return torch.compile(model, backend=recording_backend(names))(*args), names


def recording_backend(names: set[str]) -> object:
    """A ``torch.compile`` backend that runs AOT autograd's graphs as they are (no C++
    compile) and adds the names of their operators to ``names``."""

    def record(gm: torch.fx.GraphModule, _inputs) -> object:
        names.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def test_a_compiled_tt_layer_calls_the_kernels_in_one_graph() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = TTLinear(48, 40, rank=5, relu=True)
    x = torch.randn(11, 48, requires_grad=True)
    want = layer(x)
    want_grads = torch.autograd.grad(want.sum(), [x, *layer.parameters()])
    counters.clear()
    try:
        got, names = graph_targets(layer, x)
        got_grads = torch.autograd.grad(got.sum(), [x, *layer.parameters()])
        assert not counters["graph_break"], list(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    for op in ("tt_chains", "tt_chains_backward", "tt_linear", "tt_linear_backward"):
        assert f"comera_train.{op}.default" in names, sorted(names)
    assert "aten.mm.default" not in names  # no PyTorch path beside the kernels
    assert_same(got, want)
    for g, w in zip(got_grads, want_grads):
        assert_same(g, w)


def test_a_compiled_layer_with_the_kernels_off_takes_the_pytorch_path() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = TTLinear(48, 40, rank=5)
    x = torch.randn(11, 48)
    kernels.set_cpu_kernel_enabled(False)
    try:
        want = layer(x)
        got, names = graph_targets(layer, x)
    finally:
        kernels.set_cpu_kernel_enabled(True)
        torch._dynamo.reset()
    assert not any(name.startswith("comera_train.") for name in names), sorted(names)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_export_keeps_the_pytorch_path() -> None:
    # a saved program must not need this package's Python operators
    torch.manual_seed(0)
    layer = TTLinear(48, 40, rank=5, relu=True)
    program = torch.export.export(layer, (torch.randn(11, 48),), strict=False)
    names = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any(name.startswith("comera_train.") for name in names), sorted(names)
