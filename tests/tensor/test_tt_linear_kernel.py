"""The fused CPU TT linear (kernels/tt_linear_cpu.cpp) against a float64 reference and the BLAS path."""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_rec import TTLinear
from comera_rec.integration.mlp import tt_mlp
from comera_rec.tensor import kernels
from comera_rec.tensor.contract import TTLinearFunction, tt_linear
from comera_rec.tensor.kernels.cpu_extension import extension
from tests.threads import assert_bit_identical, at_thread_counts, stamps_during_call

DT = torch.float64


pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


def make(batch, n_in, n_out, rank, bias=True, dtype=DT, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n_in, generator=g, dtype=dtype).requires_grad_()
    left = (torch.randn(n_in, rank, generator=g, dtype=dtype) / n_in**0.5).requires_grad_()
    right = (torch.randn(rank, n_out, generator=g, dtype=dtype) / rank**0.5).requires_grad_()
    b = torch.randn(n_out, generator=g, dtype=dtype).requires_grad_() if bias else None
    return x, left, right, b


def reference(x, left, right, bias, relu):
    """The same product through two float64 GEMMs and autograd's own ReLU."""
    y = (x.double() @ left.double()) @ right.double()
    if bias is not None:
        y = y + bias.double()
    return torch.relu(y) if relu else y


def grads(y, inputs, g):
    inputs = [t for t in inputs if t is not None]
    return torch.autograd.grad(y, inputs, g.to(y.dtype))


# (batch, N_in, N_out, r): ranks 5 / 17 / 31 not whole vectors; batches not whole tiles
# (8 rows with AVX-512, 12 with AVX2); 700 rows: several row chunks with a short last one;
# 300 rows: chunks of whole backward blocks (64 or 96 rows) and a short one, and 84
# outputs: an odd number of vectors, 4- or 8-lane (a one-vector last panel of the packed
# right); rank 17 in float64: an odd number of rank vectors (5 with AVX2: a one-vector
# last panel of the packed left and right^T)
CASES = [
    (1, 3, 2, 1),
    (37, 13, 29, 5),
    (9, 367, 512, 17),
    (700, 64, 48, 16),
    (33, 100, 70, 24),
    (300, 40, 84, 31),
]


@pytest.mark.parametrize("batch,n_in,n_out,rank", CASES)
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_the_float64_reference(batch, n_in, n_out, rank, relu, bias) -> None:
    x, left, right, b = make(batch, n_in, n_out, rank, bias)
    assert kernels.tt_linear_kernel_applies(x, left, right)
    y = kernels.tt_linear_cpu(x, left, right, b, relu)
    want = reference(x, left, right, b, relu)
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    for got, ref in zip(grads(y, [x, left, right, b], g), grads(want, [x, left, right, b], g)):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("batch,n_in,n_out,rank", CASES[:3])
def test_without_gradients_the_kernel_is_called_directly(batch, n_in, n_out, rank) -> None:
    # scoring: no autograd node, the values of the recorded call
    x, left, right, b = make(batch, n_in, n_out, rank)
    recorded = kernels.tt_linear_cpu(x, left, right, b, True)
    with torch.no_grad():
        plain = kernels.tt_linear_cpu(x, left, right, b, True)
    with torch.inference_mode():
        inference = kernels.tt_linear_cpu(x, left, right, b, True)
    detached = kernels.tt_linear_cpu(*(t.detach() for t in (x, left, right, b)), relu=True)
    assert recorded.grad_fn is not None
    for y in (plain, inference, detached):
        assert y.grad_fn is None
        torch.testing.assert_close(y, recorded.detach(), rtol=0, atol=0)
    torch.testing.assert_close(plain, reference(x, left, right, b, True).detach())


@pytest.mark.parametrize("batch,n_in,n_out,rank", CASES)
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_operands_give_the_same_values(batch, n_in, n_out, rank, relu, bias) -> None:
    # scoring on operands packed once: bit-equal to the forward that packs them per call
    x, left, right, b = (t.detach() if t is not None else None for t in make(batch, n_in, n_out, rank, bias))
    packed = kernels.tt_linear_pack(left, right, b)
    for rows in (x, x[:1], x[: max(1, batch // 2)]):  # one packing serves any batch
        got = kernels.tt_linear_cpu_packed(rows, packed, rank, n_out, relu)
        torch.testing.assert_close(got, kernels.tt_linear_cpu(rows, left, right, b, relu), rtol=0, atol=0)
    torch.testing.assert_close(
        kernels.tt_linear_cpu_packed(x, packed, rank, n_out, relu), reference(x, left, right, b, relu)
    )


def test_packed_operands_of_another_shape_are_refused() -> None:
    x, left, right, b = (t.detach() for t in make(4, 6, 5, 3))
    packed = kernels.tt_linear_pack(left, right, b)
    with pytest.raises(RuntimeError, match="packed for another shape than 7 -> 5 at rank 3"):
        kernels.tt_linear_cpu_packed(torch.randn(4, 7, dtype=DT), packed, 3, 5)
    with pytest.raises(RuntimeError, match="packed for another shape than 6 -> 9 at rank 3"):
        kernels.tt_linear_cpu_packed(x, packed, 3, 9)
    with pytest.raises(RuntimeError, match="the operands were packed in"):
        kernels.tt_linear_cpu_packed(x.float(), packed, 3, 5)
    with pytest.raises(RuntimeError, match="bias of 4 values for 5 outputs"):
        kernels.tt_linear_pack(left, right, torch.randn(4, dtype=DT))


@pytest.mark.parametrize("rank", [16, 40, 64])
def test_float32_against_float64(rank: int) -> None:
    x, left, right, b = make(300, 96, 80, rank, dtype=torch.float32)
    y = kernels.tt_linear_cpu(x, left, right, b, True)
    want = reference(x, left, right, b, True)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    for got, ref in zip(grads(y, [x, left, right, b], g), grads(want, [x, left, right, b], g)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # float32 both: autograd casts back


def test_gradcheck() -> None:
    x, left, right, b = make(11, 7, 5, 3)
    with torch.no_grad():
        x += 0.5  # keep pre-activations away from the ReLU's kink
    assert torch.autograd.gradcheck(lambda *a: kernels.tt_linear_cpu(*a, relu=True), (x, left, right, b))
    assert torch.autograd.gradcheck(lambda *a: kernels.tt_linear_cpu(*a, relu=False), (x, left, right))


def assert_grads_match_reference(x, left, right, b, wrt) -> None:
    """The kernel's gradients of ``sum(y)`` with respect to ``wrt`` equal the reference's."""
    got = torch.autograd.grad(kernels.tt_linear_cpu(x, left, right, b, True).sum(), wrt)
    want = torch.autograd.grad(reference(x, left, right, b, True).sum(), wrt)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)


def test_input_gradient_only_when_asked() -> None:
    x, left, right, b = make(20, 12, 10, 4)
    x.requires_grad_(False)
    assert_grads_match_reference(x, left, right, b, [left, right, b])


def test_constant_left_gets_no_gradient_and_the_rest_are_unchanged() -> None:
    # a left chain that needs no gradient (NarrowLinear's identity): the kernel skips dt
    x, left, right, b = make(45, 12, 30, 12)
    x.requires_grad_(False)
    left.requires_grad_(False)
    assert_grads_match_reference(x, left, right, b, [right, b])
    # and with x needing its gradient, dt is still formed for it
    x.requires_grad_(True)
    assert_grads_match_reference(x, left, right, b, [x, right])


@pytest.mark.parametrize("threads", [2, 3])
def test_thread_counts_give_identical_results(threads: int) -> None:
    # weight gradients are summed per row chunk (set by the batch alone), then in chunk order
    x, left, right, b = make(1000, 40, 24, 9, dtype=torch.float32)

    def run():
        y = kernels.tt_linear_cpu(x, left, right, b, True)
        return [y, *torch.autograd.grad(y.square().sum(), [x, left, right, b])]

    assert_bit_identical(at_thread_counts(run, (1, threads)))


@given(
    batch=st.integers(1, 40),
    n_in=st.integers(1, 40),
    n_out=st.integers(1, 40),
    rank=st.integers(1, 32),
    relu=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_property_shapes_and_ranks(batch, n_in, n_out, rank, relu, seed) -> None:
    # every rank and width cuts the backward's weight-gradient tiles differently (rank rows
    # of grad_right, input rows of grad_left: full tiles, and a short rest merged with the
    # tile before it into two)
    x, left, right, b = make(batch, n_in, n_out, rank, seed=seed)
    y = kernels.tt_linear_cpu(x, left, right, b, relu)
    assert y.shape == (batch, n_out)
    want = reference(x, left, right, b, relu)
    torch.testing.assert_close(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    for got, ref in zip(grads(y, [x, left, right, b], g), grads(want, [x, left, right, b], g)):
        torch.testing.assert_close(got, ref)


def test_tt_linear_dispatch_matches_the_blas_path() -> None:
    layer = TTLinear(60, 40, rank=6, shape=((3, 4, 5), (2, 4, 5)), dtype=DT, relu=True)
    x = torch.randn(3, 5, 60, dtype=DT, requires_grad=True)
    params = [x, *layer.cores, *layer.controllers, layer.bias]
    out = layer(x)
    got = torch.autograd.grad(out.sum(), params)
    kernels.set_cpu_kernel_enabled(False)
    inputs, outputs = layer._split()
    want_out = tt_linear(x, inputs, outputs, 40, layer.bias, relu=True)
    want = torch.autograd.grad(want_out.sum(), params)
    torch.testing.assert_close(out, want_out)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)


def test_dispatch_switches(monkeypatch) -> None:
    x, left, right, _ = make(4, 6, 5, 3, dtype=torch.float32)
    assert kernels.tt_linear_kernel_applies(x, left, right)
    assert not kernels.tt_linear_kernel_applies(x.half(), left.half(), right.half())
    assert not kernels.tt_linear_kernel_applies(x.to("meta"), left.to("meta"), right.to("meta"))
    wide = torch.randn(6, 65)
    assert not kernels.tt_linear_kernel_applies(x, wide, torch.randn(65, 5))  # rank 65 > 4 vectors
    assert not kernels.tt_linear_kernel_applies(x.double(), torch.randn(6, 33, dtype=DT), torch.randn(33, 5, dtype=DT))
    monkeypatch.setenv(kernels.ttm_cpu.DISABLE_ENV, "1")
    assert not kernels.tt_linear_kernel_applies(x, left, right)
    monkeypatch.setenv(kernels.ttm_cpu.DISABLE_ENV, "0")
    kernels.set_cpu_kernel_enabled(False)
    assert not kernels.tt_linear_kernel_applies(x, left, right)


def test_bad_shapes_name_what_was_wrong() -> None:
    x, left, right, b = make(4, 6, 5, 3)
    with pytest.raises(RuntimeError, match="left has 7 rows for 6 input features"):
        kernels.tt_linear_cpu(x, torch.randn(7, 3, dtype=DT), right, b)
    with pytest.raises(RuntimeError, match="left has rank 3, right 4"):
        kernels.tt_linear_cpu(x, left, torch.randn(4, 5, dtype=DT), b)
    with pytest.raises(RuntimeError, match="bias of 4 values for 5 outputs"):
        kernels.tt_linear_cpu(x, left, right, torch.randn(4, dtype=DT))


def test_tt_mlp_fuses_the_relu_and_keeps_the_function() -> None:
    mlp = tt_mlp(13, [64, 48, 16], rank=4, min_gain=1.0, dtype=DT)
    fused = [p for p in mlp._mlp if isinstance(p._linear, TTLinear)]
    assert fused and all(p._linear.relu and isinstance(p._activation_fn, torch.nn.Identity) for p in fused)
    x = torch.randn(10, 13, dtype=DT)
    y = mlp(x)
    h = x
    for p in mlp._mlp:  # the layers one by one, the ReLU applied outside as TorchRec's MLP does
        lin = p._linear
        if isinstance(lin, TTLinear):
            h = torch.relu(torch.nn.functional.linear(h, lin.dense_weight(), lin.bias))
        else:
            h = p(h)
    torch.testing.assert_close(y, h)
    assert "relu=True" in repr(fused[0]._linear)


def test_blas_function_unchanged_by_the_kernel() -> None:
    # TTLinearFunction is still the path off the CPU kernel: same values as the kernel
    x, left, right, b = make(16, 10, 12, 4)
    torch.testing.assert_close(TTLinearFunction.apply(x, left, right, b), kernels.tt_linear_cpu(x, left, right, b))


# ---------------------------------------------------------------- the cross net (scoring)


def cross_reference(x0, layers):
    """``x_{k+1} = x_k + x0 * (x_k @ left @ right + bias)`` in float64 by plain operators."""
    x0 = x0.double()
    x = x0
    for left, right, bias in layers:
        x = x + x0 * reference(x, left, right, bias, relu=False)
    return x


def make_cross(batch, n, ranks, bias=True, dtype=DT, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, n, generator=g, dtype=dtype)
    layers = []
    for r in ranks:
        left = torch.randn(n, r, generator=g, dtype=dtype) / n**0.5
        right = torch.randn(r, n, generator=g, dtype=dtype) / r**0.5
        layers.append((left, right, torch.randn(n, generator=g, dtype=dtype) if bias else None))
    return x0, layers


# (batch, N, ranks per layer): batches not whole tiles, widths with a partial last vector
# (84, 13, 5), ranks not whole vectors, layers of different ranks (as after a truncation)
CROSS_CASES = [(1, 5, [1]), (13, 84, [5, 7]), (37, 96, [17, 3, 32]), (300, 13, [31, 31]), (25, 512, [32, 16, 8])]


@pytest.mark.parametrize("batch,n,ranks", CROSS_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("block_rows", [None, 1, 7, 24])
def test_cross_equals_the_float64_reference(batch, n, ranks, bias, block_rows) -> None:
    x0, layers = make_cross(batch, n, ranks, bias)
    kept = x0.clone()
    out = kernels.tt_cross_cpu(x0, layers, block_rows)
    torch.testing.assert_close(out, cross_reference(x0, layers))
    assert torch.equal(x0, kept)  # the input is left as it was


@pytest.mark.parametrize("rank", [16, 40, 64])
def test_cross_float32_against_float64(rank: int) -> None:
    x0, layers = make_cross(50, 200, [rank, rank], dtype=torch.float32)
    got = kernels.tt_cross_cpu(x0, layers, block_rows=24)
    torch.testing.assert_close(got.double(), cross_reference(x0, layers), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_cross_thread_counts_give_identical_results(threads: int) -> None:
    x0, layers = make_cross(1000, 40, [9, 4], dtype=torch.float32)
    run = lambda: [kernels.tt_cross_cpu(x0, layers, block_rows=48)]  # noqa: E731
    assert_bit_identical(at_thread_counts(run, (1, threads)))


@given(
    batch=st.integers(1, 30),
    n=st.integers(1, 40),
    ranks=st.lists(st.integers(1, 32), min_size=1, max_size=3),
    block_rows=st.integers(1, 40),
    seed=st.integers(0, 10_000),
)
def test_cross_property_shapes_and_ranks(batch, n, ranks, block_rows, seed) -> None:
    x0, layers = make_cross(batch, n, ranks, seed=seed)
    torch.testing.assert_close(kernels.tt_cross_cpu(x0, layers, block_rows), cross_reference(x0, layers))


@pytest.mark.parametrize("widths", [[13], [5, 8], [8, 5], [1, 9, 3], [4, 4, 4, 1]])
@pytest.mark.parametrize("block_rows", [None, 1, 7])
def test_cross_reads_column_blocks_as_their_concatenation(widths, block_rows) -> None:
    x0, layers = make_cross(29, sum(widths), [5, 12])
    blocks = list(x0.split(widths, dim=1))  # views with the row stride of x0: made contiguous
    got = kernels.tt_cross_cpu(blocks, layers, block_rows)
    torch.testing.assert_close(got, cross_reference(x0, layers))
    # the same arithmetic in the same order as on the joined input
    assert torch.equal(got, kernels.tt_cross_cpu(x0, layers, block_rows))


def make_next_layers(n, shapes, bias=True, dtype=DT, seed=1):
    """TT linears ``(left, right, bias, relu)`` from ``n`` inputs through ``(rank, outputs,
    relu)`` in ``shapes``."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for rank, n_out, relu in shapes:
        left = torch.randn(n, rank, generator=g, dtype=dtype) / n**0.5
        right = torch.randn(rank, n_out, generator=g, dtype=dtype) / rank**0.5
        layers.append((left, right, torch.randn(n_out, generator=g, dtype=dtype) if bias else None, relu))
        n = n_out
    return layers


def mlp_reference(x, next_layers):
    for left, right, bias, relu in next_layers:
        x = reference(x, left, right, bias, relu)
    return x


# (batch, N, cross ranks, next layers (rank, outputs, relu)): outputs below, at and past a
# vector's width, ranks not whole vectors, a layer narrower then wider than the one before,
# and an MLPerf-like top MLP at rank 16
NEXT_CASES = [
    (1, 5, [1], [(1, 1, True)]),
    (13, 84, [5, 7], [(3, 20, True), (5, 9, False)]),
    (37, 96, [17, 3, 32], [(17, 8, True), (4, 40, True), (2, 3, False)]),
    (50, 200, [8, 8], [(16, 64, True), (16, 64, True), (16, 32, True), (16, 16, True)]),
]


@pytest.mark.parametrize("batch,n,ranks,shapes", NEXT_CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("block_rows", [1, 7, 24])
def test_cross_then_tt_linears_equal_the_float64_reference(batch, n, ranks, shapes, bias, block_rows) -> None:
    x0, layers = make_cross(batch, n, ranks)
    next_layers = make_next_layers(n, shapes, bias)
    got = kernels.tt_cross_cpu(x0, layers, block_rows, next_layers=next_layers)
    assert got.shape == (batch, shapes[-1][1])
    torch.testing.assert_close(got, mlp_reference(cross_reference(x0, layers), next_layers))
    # the same arithmetic as the net's output handed to the fused TT linears one by one
    want = kernels.tt_cross_cpu(x0, layers, block_rows)
    for left, right, b, relu in next_layers:
        want = kernels.tt_linear_cpu(want, left, right, b, relu)
    assert torch.equal(got, want)


@pytest.mark.parametrize("widths", [[13], [5, 8], [1, 9, 3]])
def test_cross_then_tt_linears_read_column_blocks(widths) -> None:
    x0, layers = make_cross(29, sum(widths), [5, 12])
    next_layers = make_next_layers(sum(widths), [(6, 10, True), (3, 4, False)])
    got = kernels.tt_cross_cpu(list(x0.split(widths, dim=1)), layers, 7, next_layers=next_layers)
    assert torch.equal(got, kernels.tt_cross_cpu(x0, layers, 7, next_layers=next_layers))


@pytest.mark.parametrize("threads", [2, 3])
def test_cross_then_tt_linears_are_identical_at_any_thread_count(threads: int) -> None:
    x0, layers = make_cross(1000, 40, [9, 4], dtype=torch.float32)
    next_layers = make_next_layers(40, [(12, 30, True), (5, 7, True)], dtype=torch.float32)
    run = lambda: [kernels.tt_cross_cpu(x0, layers, 48, next_layers=next_layers)]  # noqa: E731
    assert_bit_identical(at_thread_counts(run, (1, threads)))


@given(
    batch=st.integers(1, 30),
    n=st.integers(1, 40),
    ranks=st.lists(st.integers(1, 32), min_size=1, max_size=3),
    shapes=st.lists(st.tuples(st.integers(1, 32), st.integers(1, 40), st.booleans()), min_size=1, max_size=3),
    block_rows=st.integers(1, 40),
    seed=st.integers(0, 10_000),
)
def test_cross_then_tt_linears_property_shapes_and_ranks(batch, n, ranks, shapes, block_rows, seed) -> None:
    x0, layers = make_cross(batch, n, ranks, seed=seed)
    next_layers = make_next_layers(n, shapes, seed=seed + 1)
    got = kernels.tt_cross_cpu(x0, layers, block_rows, next_layers=next_layers)
    torch.testing.assert_close(got, mlp_reference(cross_reference(x0, layers), next_layers))


def test_cross_then_tt_linears_bad_inputs_name_what_was_wrong() -> None:
    x0, layers = make_cross(4, 6, [3])
    (left, right, b, _), (left2, right2, b2, _) = make_next_layers(6, [(2, 5, True), (3, 4, True)])
    with pytest.raises(RuntimeError, match="left has 7 rows for 6 input features"):
        kernels.tt_cross_cpu(x0, layers, next_layers=[(torch.randn(7, 2, dtype=DT), right, b, True)])
    with pytest.raises(RuntimeError, match="left has rank 2, right 3"):
        kernels.tt_cross_cpu(x0, layers, next_layers=[(left, torch.randn(3, 5, dtype=DT), b, True)])
    with pytest.raises(RuntimeError, match="bias of 4 values for 5 outputs"):
        kernels.tt_cross_cpu(x0, layers, next_layers=[(left, right, b[:4], True)])
    # the second layer takes the first's 5 outputs
    with pytest.raises(RuntimeError, match="left has 6 rows for 5 input features"):
        kernels.tt_cross_cpu(
            x0, layers, next_layers=[(left, right, b, True), (torch.randn(6, 3, dtype=DT), right2, b2, True)]
        )
    with pytest.raises(RuntimeError, match="next layer 0's left is empty"):
        kernels.tt_cross_cpu(x0, layers, next_layers=[(left[:, :0], right[:0], b, True)])
    with pytest.raises(RuntimeError, match="scoring only"):
        kernels.tt_cross_cpu(x0, layers, next_layers=[(left, right.requires_grad_(), b, True)])


def test_cross_bad_inputs_name_what_was_wrong() -> None:
    x0, ((left, right, b),) = make_cross(4, 6, [3])
    with pytest.raises(RuntimeError, match="layer 0 has 5 outputs for 6 input features; a cross layer keeps its width"):
        kernels.tt_cross_cpu(x0, [(left, right[:, :5], b[:5])])
    with pytest.raises(RuntimeError, match="left has 7 rows for 6 input features"):
        kernels.tt_cross_cpu(x0, [(torch.randn(7, 3, dtype=DT), right, b)])
    with pytest.raises(RuntimeError, match="0 lefts, 0 rights and 0 biases"):
        kernels.tt_cross_cpu(x0, [])
    with pytest.raises(RuntimeError, match="block_rows must be positive, got 0"):
        kernels.tt_cross_cpu(x0, [(left, right, b)], block_rows=0)
    with pytest.raises(RuntimeError, match=r"x0's column block 1 has shape \[3, 2\]; each must be \(B, N_p\)"):
        kernels.tt_cross_cpu([x0[:, :4], x0[:3, 4:]], [(left, right, b)])
    with pytest.raises(RuntimeError, match="left has 6 rows for 5 input features"):
        kernels.tt_cross_cpu([x0[:, :4], x0[:, 4:5]], [(left, right, b)])
    with pytest.raises(RuntimeError, match="column blocks need one dtype"):
        kernels.tt_cross_cpu([x0[:, :4], x0[:, 4:].float()], [(left, right, b)])
    with pytest.raises(RuntimeError, match="scoring only"):
        kernels.tt_cross_cpu(x0, [(left.requires_grad_(), right, b)])


def test_kernel_lets_other_python_threads_run() -> None:
    def make_call(rows: int):
        x, left, right, b = (t.detach() for t in make(rows, 256, 256, 32, dtype=torch.float32))
        return functools.partial(extension().tt_linear_forward, x, left, right, b, True)

    assert stamps_during_call(make_call) > 0
