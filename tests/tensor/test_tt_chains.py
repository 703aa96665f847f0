"""A TT weight's chains merged in C++ (kernels/tt_linear_cpu.cpp, tt_chains_*) against the
composed PyTorch merge of the controller-scaled cores and a dense float64 reconstruction."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_rec import TTLinear
from comera_rec.tensor import kernels
from comera_rec.tensor.contract import merge_input_chain, merge_output_chain

DT = torch.float64

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


def make_layer(in_features, out_features, rank, shape, seed=0):
    """A float64 TTLinear with controllers drawn away from 1 (so a misplaced one shows)."""
    torch.manual_seed(seed)
    layer = TTLinear(in_features, out_features, rank, shape=shape, dtype=DT)
    with torch.no_grad():
        for d in layer.controllers:
            d.uniform_(0.5, 1.5)
    return layer


def split(layer):
    d = len(layer.in_shape)
    cores = list(layer.cores)
    return cores[:d], cores[d:], list(layer.controllers)


def dense_reference(layer):
    """``W^T (in, out)``: every core scaled by its controllers, contracted one by one."""
    cores = [c.detach() for c in layer.cores]
    out = cores[0]
    for k, core in enumerate(cores[1:]):
        out = torch.tensordot(out * layer.controllers[k].detach(), core, dims=([-1], [0]))
    n_in, n_out = math.prod(layer.in_shape), math.prod(layer.out_shape)
    return out.reshape(n_in, n_out)[: layer.in_features, : layer.out_features]


# (in_features, out_features, rank, shape): one to four cores a side; features below the
# modes' products (the chains are cut to them); ranks differing per bond
CASES = [
    (13, 7, 4, ((13,), (7,))),
    (30, 20, 3, ((5, 6), (4, 5))),
    (59, 50, [2, 5, 3, 4, 2], ((3, 4, 5), (5, 5, 2))),
    (100, 90, 3, ((2, 2, 5, 5), (3, 3, 2, 5))),
    (367, 512, [6, 32, 32, 32, 8], ((6, 7, 9), (8, 8, 8))),
]


@pytest.mark.parametrize("in_features,out_features,rank,shape", CASES)
def test_product_equals_the_dense_reconstruction(in_features, out_features, rank, shape) -> None:
    layer = make_layer(in_features, out_features, rank, shape)
    inputs, outputs, controllers = split(layer)
    left, right = kernels.tt_chains_cpu(inputs, outputs, controllers, in_features, out_features)
    assert left.shape == (in_features, layer.ranks[len(inputs) - 1])
    assert right.shape == (layer.ranks[len(inputs) - 1], out_features)
    torch.testing.assert_close(left @ right, dense_reference(layer), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("in_features,out_features,rank,shape", CASES)
def test_gradients_equal_the_composed_merge(in_features, out_features, rank, shape) -> None:
    # The two merges put the controllers on different sides (a chain of ours may differ
    # from the composed one by a diagonal), so they are compared through the product.
    layer = make_layer(in_features, out_features, rank, shape)
    inputs, outputs, controllers = split(layer)
    params = list(layer.cores) + list(layer.controllers)
    grad_w = torch.randn(in_features, out_features, generator=torch.Generator().manual_seed(1), dtype=DT)

    left, right = kernels.tt_chains_cpu(inputs, outputs, controllers, in_features, out_features)
    ours = torch.autograd.grad((left @ right * grad_w).sum(), params)

    scaled_in, scaled_out = layer._split()  # controllers folded into the cores
    ref = merge_input_chain(scaled_in)[:in_features] @ merge_output_chain(scaled_out)[:, :out_features]
    torch.testing.assert_close(left @ right, ref, rtol=1e-12, atol=1e-12)
    theirs = torch.autograd.grad((ref * grad_w).sum(), params)
    names = [f"core {k}" for k in range(len(layer.cores))] + [f"controller {k}" for k in range(len(controllers))]
    for name, a, b in zip(names, ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_gradcheck() -> None:
    layer = make_layer(10, 9, [2, 3, 2], ((2, 5), (3, 3)))
    d = len(layer.in_shape)
    cores = [c.detach().clone().requires_grad_() for c in layer.cores]
    controllers = [c.detach().clone().requires_grad_() for c in layer.controllers]

    def chains(*tensors):
        return kernels.tt_chains_cpu(tensors[:d], tensors[d : 2 * d], tensors[2 * d :], 9, 8)

    assert torch.autograd.gradcheck(chains, (*cores, *controllers))


def test_one_chain_used_gives_zero_gradient_through_the_other() -> None:
    layer = make_layer(30, 20, 3, ((5, 6), (4, 5)))
    inputs, outputs, controllers = split(layer)
    left, _ = kernels.tt_chains_cpu(inputs, outputs, controllers, 30, 20)
    grads = torch.autograd.grad(left.sum(), list(layer.cores), allow_unused=True)
    assert grads[0].abs().sum() > 0  # the input side gets a gradient
    for k in (2, 3):  # the output cores do not enter left
        assert grads[k] is None or torch.count_nonzero(grads[k]) == 0


def test_bad_inputs_name_what_was_wrong() -> None:
    layer = make_layer(30, 20, 3, ((5, 6), (4, 5)))
    inputs, outputs, controllers = split(layer)
    with pytest.raises(RuntimeError, match="controllers"):
        kernels.tt_chains_cpu(inputs, outputs, controllers[:-1], 30, 20)
    with pytest.raises(RuntimeError, match="features"):
        kernels.tt_chains_cpu(inputs, outputs, controllers, 31, 20)
    with pytest.raises(ValueError, match="output cores"):
        kernels.tt_chains_cpu(inputs, outputs[:1], controllers, 30, 20)


def test_tt_linear_takes_the_cpp_chains_and_matches_the_composed_path() -> None:
    layer = make_layer(59, 50, [2, 5, 3, 4, 2], ((3, 4, 5), (5, 5, 2)))
    layer.relu = True
    x = torch.randn(17, 59, dtype=DT, requires_grad=True)
    results = []
    for on in (True, False):
        kernels.set_cpu_kernel_enabled(on)
        calls = []
        original = kernels.tt_chains_cpu
        kernels.tt_chains_cpu = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            y = layer(x)
            grads = torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])
        finally:
            kernels.tt_chains_cpu = original
        assert bool(calls) == on  # the C++ chains exactly when the kernels are on
        results.append([y, *grads])
    kernels.set_cpu_kernel_enabled(True)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "in_features,out_features,rank,shape", [CASES[1], CASES[-1], (512, 256, 32, ((8, 8, 8), (4, 8, 8)))]
)
def test_float32_merges_match_the_float64_ones(in_features, out_features, rank, shape) -> None:
    # float32 runs other vector tiles (twice the lanes) than the float64 tests above
    layer = make_layer(in_features, out_features, rank, shape)
    inputs, outputs, controllers = split(layer)
    grad_w = torch.randn(in_features, out_features, generator=torch.Generator().manual_seed(2), dtype=DT)
    params = list(layer.cores) + list(layer.controllers)

    def product_and_grads(dtype):
        ps = [p.detach().to(dtype).requires_grad_() for p in params]
        d = len(inputs)
        left, right = kernels.tt_chains_cpu(ps[:d], ps[d : 2 * d], ps[2 * d :], in_features, out_features)
        product = left @ right
        return product.double(), [g.double() for g in torch.autograd.grad((product * grad_w.to(dtype)).sum(), ps)]

    product32, grads32 = product_and_grads(torch.float32)
    product64, grads64 = product_and_grads(DT)
    torch.testing.assert_close(product32, product64, rtol=1e-5, atol=1e-5)
    for k, (a, b) in enumerate(zip(grads32, grads64)):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(scale, 1.0), msg=lambda m, k=k: f"tensor {k}: {m}")


@settings(max_examples=25, deadline=None)
@given(
    in_modes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    out_seed=st.integers(0, 10_000),
    rank=st.integers(1, 6),
    data=st.data(),
)
def test_property_shapes_and_ranks(in_modes, out_seed, rank, data) -> None:
    d = len(in_modes)
    out_modes = data.draw(st.lists(st.integers(1, 4), min_size=d, max_size=d))
    in_features = data.draw(st.integers(1, math.prod(in_modes)))
    out_features = data.draw(st.integers(1, math.prod(out_modes)))
    layer = make_layer(in_features, out_features, rank, (in_modes, out_modes), seed=out_seed)
    inputs, outputs, controllers = split(layer)
    left, right = kernels.tt_chains_cpu(inputs, outputs, controllers, in_features, out_features)
    assert left.shape[0] == in_features and right.shape[1] == out_features
    torch.testing.assert_close(left @ right, dense_reference(layer), rtol=1e-12, atol=1e-12)
