import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from comera_rec import TTLinear
from comera_rec.tensor import NarrowLinear, kernels
from comera_rec.tensor.contract import TTLinearFunction

from .reference import linear_weight

DT = torch.float64


def randomize_controllers(layer) -> None:
    with torch.no_grad():
        for d in layer.controllers:
            d.uniform_(0.5, 1.5)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_backward_match_dense_reconstruction(bias: bool, relu: bool, lookup_path: str) -> None:
    layer = TTLinear(30, 20, rank=4, bias=bias, shape=((2, 3, 5), (2, 2, 5)), dtype=DT, relu=relu)
    randomize_controllers(layer)
    x = torch.randn(7, 3, 30, dtype=DT, requires_grad=True)
    w = linear_weight(layer)
    ref = F.linear(x, w, layer.bias)
    ref = F.relu(ref) if relu else ref
    out = layer(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(layer.dense_weight(), w)

    g = torch.randn_like(out)
    params = [x, *layer.cores, *layer.controllers]
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref, params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_custom_function_gradcheck() -> None:
    x = torch.randn(5, 6, dtype=DT, requires_grad=True)
    left = torch.randn(6, 3, dtype=DT, requires_grad=True)
    right = torch.randn(3, 4, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(TTLinearFunction.apply, (x, left, right))
    bias = torch.randn(4, dtype=DT, requires_grad=True)  # added by the GEMM (addmm)
    assert torch.autograd.gradcheck(TTLinearFunction.apply, (x, left, right, bias))
    y = TTLinearFunction.apply(x, left, right, bias)
    torch.testing.assert_close(y, x @ left @ right + bias)


def test_backward_saves_only_input_and_rank_intermediate(lookup_path: str) -> None:
    layer = TTLinear(64, 64, rank=4, shape=((8, 8), (8, 8)), dtype=DT)
    x = torch.randn(100, 64, dtype=DT, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum()
    batch_sized = [s for s in saved if 100 in s]
    # x (100, 64) and x @ left (100, r) (the kernel pads r to whole vectors: 8 doubles with
    # AVX-512, 4 with AVX2); never a (100, 64)-sized output intermediate twice.
    lanes = kernels.cpu_vector_bytes() // 8
    rank_width = -(-4 // lanes) * lanes if lookup_path == "kernel" else 4
    assert sorted(batch_sized) == [(100, rank_width), (100, 64)]


@given(
    in_shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    out_seed=st.integers(0, 1000),
    rank=st.integers(1, 5),
    batch=st.integers(1, 4),
)
def test_property_shapes_and_ranks(in_shape, out_seed, rank, batch) -> None:
    g = torch.Generator().manual_seed(out_seed)
    out_shape = [int(v) for v in torch.randint(1, 5, (len(in_shape),), generator=g)]
    n_in = max(1, int(torch.tensor(in_shape).prod()) - 1)
    n_out = int(torch.tensor(out_shape).prod())
    layer = TTLinear(n_in, n_out, rank=rank, shape=(in_shape, out_shape), dtype=DT)
    assert all(r <= rank for r in layer.ranks)
    x = torch.randn(batch, n_in, dtype=DT)
    torch.testing.assert_close(layer(x), F.linear(x, linear_weight(layer), layer.bias))


def test_truncation_keeps_output_and_shrinks() -> None:
    layer = TTLinear(64, 48, rank=6, shape=((4, 4, 4), (4, 4, 3)), dtype=DT)
    with torch.no_grad():
        layer.controllers[1][[0, 2, 5]] = 0.0
        layer.controllers[2][1] = 1e-4
    x = torch.randn(9, 64, dtype=DT)
    before, params_before = layer(x), layer.num_parameters()
    assert layer.live_ranks(1e-2) == [4, 3, 5, 6, 3]
    assert layer.truncate_ranks(1e-2)
    assert layer.ranks == [4, 3, 5, 6, 3]
    assert layer.num_parameters() < params_before
    torch.testing.assert_close(layer(x), before, atol=1e-3, rtol=0)
    assert not layer.truncate_ranks(1e-2)  # nothing left to cut


def test_truncation_of_exact_zeros_is_exact() -> None:
    layer = TTLinear(16, 16, rank=4, shape=((4, 4), (4, 4)), dtype=DT)
    with torch.no_grad():
        layer.controllers[1][:2] = 0.0
    x = torch.randn(3, 16, dtype=DT)
    before = layer(x)
    layer.truncate_ranks(1e-2)
    torch.testing.assert_close(layer(x), before)


def test_size_accounting() -> None:
    layer = TTLinear(16, 16, rank=3, shape=((4, 4), (4, 4)), dtype=DT)
    assert layer.ranks == [3, 3, 3]
    # S = 1*4*3 + 3*4*3 + 3*4*3 + 3*4*1
    assert layer.tt_size() == 12 + 36 + 36 + 12
    assert layer.num_parameters() == 96 + 9 + 16
    assert layer.compression_ratio() == pytest.approx((256 + 16) / 121)
    total, count = layer.size_surrogate()
    assert count == 9 and float(total.detach()) == pytest.approx(9.0)
    with torch.no_grad():
        layer.controllers[0][0] = 0.0
    assert layer.tt_size(0.5) == 1 * 4 * 2 + 2 * 4 * 3 + 36 + 12
    assert layer.size_surrogate(0.5)[1] == 8


def test_from_linear_exact_at_full_rank() -> None:
    dense = nn.Linear(24, 10).double()
    tt = TTLinear.from_linear(dense, rank=100, shape=((2, 3, 4), (2, 5, 1)))
    x = torch.randn(4, 24, dtype=DT)
    torch.testing.assert_close(tt(x), dense(x))
    low = TTLinear.from_linear(dense, rank=2, shape=((2, 3, 4), (2, 5, 1)))
    assert max(low.ranks) <= 2


def test_meta_device_and_reset() -> None:
    layer = TTLinear(32, 32, rank=4, device="meta")
    assert all(c.is_meta for c in layer.cores)
    layer = layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert torch.isfinite(layer(torch.randn(2, 32))).all()


def test_init_matches_nn_linear_scale() -> None:
    layer = TTLinear(512, 512, rank=16, dtype=DT)
    std = float(layer.dense_weight().detach().std())
    assert 0.5 * (1 / (3 * 512)) ** 0.5 < std < 2.0 * (1 / (3 * 512)) ** 0.5


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        TTLinear(8, 8, rank=0)
    with pytest.raises(TypeError, match="floating point"):
        TTLinear(8, 8, rank=2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"product 6.*cannot hold dimension 8"):
        TTLinear(8, 8, rank=2, shape=((2, 3), (2, 4)))
    with pytest.raises(ValueError, match="same number"):
        TTLinear(8, 8, rank=2, shape=((2, 4), (2, 2, 2)))
    with pytest.raises(ValueError, match="in_features must be a positive integer"):
        TTLinear(0, 8, rank=2)
    layer = TTLinear(8, 8, rank=2)
    with pytest.raises(ValueError, match="last dimension 8"):
        layer(torch.randn(2, 9))


def test_scaled_cores_fold_each_controller_into_the_smaller_neighbour() -> None:
    # in (2, 3, 20) x out (2, 2, 5), rank 6: core sizes 12, 108, 720, 72, 72, 30
    layer = TTLinear(120, 20, rank=6, shape=((2, 3, 20), (2, 2, 5)), dtype=DT)
    randomize_controllers(layer)
    scaled = layer.scaled_cores()
    sizes = [c.numel() for c in layer.cores]
    for k in range(len(layer.controllers)):
        smaller = k + 1 if sizes[k + 1] < sizes[k] else k
        assert scaled[smaller] is not layer.cores[smaller]
    untouched = [k for k in range(len(sizes)) if scaled[k] is layer.cores[k]]
    assert untouched, "a core whose neighbours are both smaller is left as it is"
    assert 2 in untouched  # the (6, 20, 6) core is larger than both its neighbours
    torch.testing.assert_close(layer.dense_weight(), linear_weight(layer))


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_in", [1, 13, 32, 40])
def test_narrow_linear_equals_linear(n_in: int, relu: bool, bias: bool, lookup_path: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(n_in, 70, bias=bias, dtype=DT)
    layer = NarrowLinear.from_linear(linear, relu=relu)
    assert layer.weight is linear.weight and list(layer.state_dict()) == list(linear.state_dict())
    x = torch.randn(37, n_in, dtype=DT, requires_grad=True)  # not whole 8-row tiles
    want = linear(x)
    want = torch.relu(want) if relu else want
    got = layer(x)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    params = [x, *linear.parameters()]
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("batch", [1, 37])
def test_narrow_linear_scores_with_blas(batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # without gradients the fused kernel has nothing to win: F.linear, the ReLU in place
    torch.manual_seed(0)
    layer = NarrowLinear(13, 40, relu=True, dtype=DT)
    x = torch.randn(batch, 13, dtype=DT)
    want = torch.relu(F.linear(x, layer.weight, layer.bias))

    def no_kernel(*args, **kwargs):
        raise AssertionError("the fused kernel was called while scoring")

    monkeypatch.setattr(kernels, "tt_linear_cpu", no_kernel)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    if kernels.cpu_kernel_enabled():  # with gradients the kernel runs
        with pytest.raises(AssertionError, match="fused kernel"):
            layer(x.requires_grad_())


def test_narrow_linear_gradcheck_and_leading_dims() -> None:
    layer = NarrowLinear(5, 9, relu=True, dtype=DT)
    x = (torch.rand(6, 5, dtype=DT) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda v: layer(v), (x,))
    x3 = torch.randn(2, 3, 5, dtype=DT)  # not a matrix: the F.linear path
    torch.testing.assert_close(layer(x3), torch.relu(F.linear(x3, layer.weight, layer.bias)))
    assert "relu=True" in repr(layer)


def test_narrow_linear_float32_weight_gradient_against_float64() -> None:
    # the first DLRM layer's shape: 13 inputs, 512 outputs, a batch of 300
    torch.manual_seed(1)
    layer = NarrowLinear(13, 512, relu=True)
    x = torch.randn(300, 13).abs()
    g = torch.randn(300, 512)
    layer(x).backward(g)
    ref = NarrowLinear(13, 512, relu=True, dtype=DT)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    ref.weight.grad = None
    torch.relu(F.linear(x.double(), ref.weight, ref.bias)).backward(g.double())
    torch.testing.assert_close(layer.weight.grad.double(), ref.weight.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.bias.grad.double(), ref.bias.grad, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False])
def test_chains_make_the_dense_weight(kernel: bool) -> None:
    layer = TTLinear(30, 20, rank=[3, 5, 4, 5, 2], shape=((2, 3, 5), (4, 5, 1)), dtype=torch.float64)
    with torch.no_grad():
        for c in layer.controllers:
            c.uniform_(0.5, 1.5)
    was = kernels.cpu_kernel_enabled()
    kernels.set_cpu_kernel_enabled(kernel)
    try:
        left, right = layer.chains()
    finally:
        kernels.set_cpu_kernel_enabled(was)
    assert left.shape == (30, 4) and right.shape == (4, 20)  # the middle bond's rank
    torch.testing.assert_close((left @ right).t(), layer.dense_weight())
    grads = torch.autograd.grad((left @ right).square().sum(), list(layer.cores))  # differentiable
    assert all(g.abs().sum() > 0 for g in grads)


def test_scoring_keeps_the_merged_chains_on_either_path(lookup_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``cached_weights`` without gradients the chains are merged once and kept, by the
    C++ merge or (where it does not apply, as on a GPU) by torch operators; an in-place write
    to a core makes them again; each call equals the float64 dense weight's product."""
    from comera_rec.tensor import cached_weights, linear

    torch.manual_seed(0)
    layer = TTLinear(30, 20, rank=[3, 5, 4, 5, 2], shape=((2, 3, 5), (4, 5, 1)), relu=True)
    x = torch.randn(6, 30)
    merges: list[int] = []
    real = linear.merge_input_chain
    monkeypatch.setattr(linear, "merge_input_chain", lambda cores: merges.append(1) or real(cores))

    def expect(made: int) -> None:
        ref = torch.relu(x.double() @ layer.dense_weight().double().t() + layer.bias.double())
        merges.clear()
        before = kernels.tt_chains_kernel_applies(layer.train_tensors(), ())
        torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
        # the torch merge runs only where the C++ one does not apply
        assert len(merges) == (0 if before else made)

    with torch.no_grad(), cached_weights():
        expect(made=1)
        assert linear.derived_cache(layer, "chains").peek(layer.train_tensors()) is not None
        expect(made=0)  # kept
        layer.cores[0].mul_(1.25)
        assert linear.derived_cache(layer, "chains").peek(layer.train_tensors()) is None
        expect(made=1)
    with torch.no_grad():
        assert linear.derived_cache(layer, "chains").peek(layer.train_tensors()) is None  # dropped


def test_scoring_packs_the_kept_chains_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the fused CPU kernel, scoring packs the kept chains and bias once; a write to the
    bias or a core packs again; every call equals the float64 reference, any batch shape."""
    from comera_rec.tensor import cached_weights, linear

    if not kernels.tt_linear_kernel_applies(torch.zeros(1, 30), torch.zeros(30, 4), torch.zeros(4, 20)):
        pytest.skip("the fused CPU TT linear is not built here")
    torch.manual_seed(0)
    layer = TTLinear(30, 20, rank=[3, 5, 4, 5, 2], shape=((2, 3, 5), (4, 5, 1)), relu=True)
    packs: list[int] = []
    real = kernels.tt_linear_pack
    monkeypatch.setattr(linear.kernels, "tt_linear_pack", lambda *a: packs.append(1) or real(*a))
    used: list[int] = []
    real_call = kernels.tt_linear_cpu_packed
    monkeypatch.setattr(linear.kernels, "tt_linear_cpu_packed", lambda *a: used.append(1) or real_call(*a))

    def check(x: torch.Tensor) -> None:
        ref = torch.relu(x.double() @ layer.dense_weight().double().t() + layer.bias.double())
        torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)

    with torch.no_grad(), cached_weights():
        for x in (torch.randn(1, 30), torch.randn(13, 30), torch.randn(2, 3, 30)):
            check(x)
        assert len(packs) == 1
        layer.bias.add_(0.5)
        check(torch.randn(5, 30))
        layer.cores[2].mul_(0.5)
        check(torch.randn(5, 30))
        assert len(packs) == 3
        # what the kept operands do not fit still gets the general path's named errors
        with pytest.raises(ValueError, match="expected input with last dimension 30"):
            layer(torch.randn(5, 31))
        with pytest.raises(TypeError, match="input dtype torch.float64 differs"):
            layer(torch.randn(5, 30, dtype=torch.float64))
        was = kernels.cpu_kernel_enabled()
        kernels.set_cpu_kernel_enabled(False)  # switched off inside the scope: not used
        try:
            calls = len(used)
            check(torch.randn(5, 30))
            assert len(used) == calls
        finally:
            kernels.set_cpu_kernel_enabled(was)
    assert len(used) == 5  # every call above but the refused and the switched-off ones
    with torch.no_grad():
        check(torch.randn(5, 30))  # outside the scope: nothing packed or kept
    assert len(packs) == 3 and len(used) == 5
