"""TTLowRankCrossNet's scoring path (integration/mlp.py): each cross layer's two TT
projections merged into one weight and run by the fused cross kernel, against the layers
called one by one and a float64 reference from the dense weights."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from comera_rec.integration.mlp import TTLowRankCrossNet, merge_projections
from comera_rec.tensor import TTLinear, cached_weights, kernels
from comera_rec.tensor.derived import derived_cache

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


def make_net(n=96, layers=3, low_rank=32, rank=4, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    net = TTLowRankCrossNet(n, layers, low_rank, tt_rank=rank, min_gain=1.0, dtype=dtype)
    with torch.no_grad():
        for b in net.bias:
            b.normal_()
    return net


def dense_reference(net: TTLowRankCrossNet, x0: torch.Tensor) -> torch.Tensor:
    """The cross net from the dense projection weights, in float64."""
    x0 = x0.double()
    x = x0
    for v, w, b in zip(net.V, net.W, net.bias):
        weight_v = v.dense_weight().double() if isinstance(v, TTLinear) else v.weight.double()
        weight_w = w.dense_weight().double() if isinstance(w, TTLinear) else w.weight.double()
        x = x + x0 * ((x @ weight_v.t()) @ weight_w.t() + b.double())
    return x


def test_scoring_equals_the_layers_one_by_one_and_the_dense_reference() -> None:
    net = make_net()
    assert all(isinstance(m, TTLinear) for m in (*net.V, *net.W))
    x = torch.randn(13, 96, dtype=torch.float64)
    recorded = net(x)  # gradients recorded: the layers one by one
    assert recorded.requires_grad
    with torch.inference_mode(), cached_weights():
        scored = net(x)
        again = net(x)
    torch.testing.assert_close(scored, recorded)
    torch.testing.assert_close(again, recorded)
    torch.testing.assert_close(scored, dense_reference(net, x))


def test_scoring_leaves_the_input_as_it_was() -> None:
    net = make_net()
    x = torch.randn(5, 96, dtype=torch.float64)
    kept = x.clone()
    with torch.no_grad():
        net(x)
    assert torch.equal(x, kept)


def test_scoring_takes_the_fused_kernel(monkeypatch) -> None:
    net = make_net()
    calls = []
    fused = kernels.tt_cross_cpu
    monkeypatch.setattr(kernels, "tt_cross_cpu", lambda x0, layers: calls.append(len(layers)) or fused(x0, layers))
    with torch.no_grad():
        net(torch.randn(3, 96, dtype=torch.float64))
    assert calls == [3]  # the whole net in one call
    calls.clear()
    net(torch.randn(3, 96, dtype=torch.float64))  # gradients recorded: not the scoring kernel
    assert calls == []


def test_forward_blocks_scores_the_blocks_without_joining_them(monkeypatch) -> None:
    net = make_net()
    x = torch.randn(11, 96, dtype=torch.float64)
    blocks = [x[:, :16], x[:, 16:]]  # DCN: the dense features, then the pooled embeddings
    calls = []
    fused = kernels.tt_cross_cpu
    monkeypatch.setattr(
        kernels, "tt_cross_cpu", lambda x0, layers: calls.append(type(x0).__name__) or fused(x0, layers)
    )
    with torch.inference_mode(), cached_weights():
        got = net.forward_blocks(blocks)
    assert calls == ["list"]  # the blocks as they are, no (B, N) input made
    torch.testing.assert_close(got, dense_reference(net, x))
    # gradients recorded: the layers on the concatenation, the gradient reaching each block
    dense, sparse = (b.clone().requires_grad_() for b in blocks)
    net.forward_blocks([dense, sparse]).square().sum().backward()
    joined = x.clone().requires_grad_()
    net(joined).square().sum().backward()
    torch.testing.assert_close(torch.cat([dense.grad, sparse.grad], dim=1), joined.grad)
    with pytest.raises(ValueError, match="expected input with last dimension 96, got shape"):  # the layers' error
        with torch.no_grad():
            net.forward_blocks([x[:, :16], x[:, 17:]])


def test_merged_weights_are_kept_while_the_parameters_do_not_change() -> None:
    net = make_net()
    x = torch.randn(4, 96, dtype=torch.float64)
    with torch.no_grad(), cached_weights():
        first = net(x)
        assert len(derived_cache(net, "cross_0")) == 1
        net.W[0].cores[0].mul_(2.0)  # an in-place write: the merged weight is made again
        second = net(x)
    torch.testing.assert_close(second, dense_reference(net, x))
    assert not torch.allclose(first, second)
    assert len(derived_cache(net, "cross_0")) == 0  # dropped when the scope closes


def test_after_a_rank_truncation() -> None:
    net = make_net(rank=6)
    with torch.no_grad():
        net.V[1].controllers[0][::2] = 0.0  # half of one bond's ranks to cut
    assert net.V[1].truncate_ranks(1e-12)
    x = torch.randn(7, 96, dtype=torch.float64)
    with torch.inference_mode(), cached_weights():
        torch.testing.assert_close(net(x), dense_reference(net, x))


def test_a_dense_projection_keeps_the_layer_by_layer_path() -> None:
    net = make_net()
    net.V[1] = nn.Linear(96, 32, bias=False, dtype=torch.float64)
    x = torch.randn(6, 96, dtype=torch.float64)
    with torch.no_grad():
        assert net._merged_layers([x]) is None
        torch.testing.assert_close(net(x), dense_reference(net, x))


def test_without_the_kernels_the_same_values(monkeypatch) -> None:
    net = make_net()
    x = torch.randn(6, 96, dtype=torch.float64)
    with torch.no_grad():
        fused = net(x)
        kernels.set_cpu_kernel_enabled(False)
        assert net._merged_layers([x]) is None
        plain = net(x)
    torch.testing.assert_close(fused, plain)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 40),
    low_rank=st.integers(1, 24),
    rank_v=st.integers(1, 8),
    rank_w=st.integers(1, 8),
    seed=st.integers(0, 1000),
)
def test_merge_projections_property(n, low_rank, rank_v, rank_w, seed) -> None:
    torch.manual_seed(seed)
    v = TTLinear(n, low_rank, rank_v, bias=False, dtype=torch.float64)
    w = TTLinear(low_rank, n, rank_w, bias=False, dtype=torch.float64)
    left, right = merge_projections(v, w)
    assert left.shape[0] == n and right.shape[1] == n and left.shape[1] == right.shape[0]
    # the merged weight keeps the lower of the two layers' (capped) ranks
    assert left.shape[1] == min(v.chains()[0].shape[1], w.chains()[0].shape[1])
    want = (w.dense_weight() @ v.dense_weight()).t()
    torch.testing.assert_close(left @ right, want)


def test_fx_tracing_sees_the_layers() -> None:
    # TorchRec's train pipelines FX-trace a model none of whose tables is sharded: the net
    # must trace (no checks on a proxy), each TT projection one call
    net = make_net()
    traced = torch.fx.symbolic_trace(net)
    x = torch.randn(4, 96, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), net(x))


def test_training_runs_each_layer_as_its_merged_weight_with_the_same_gradients() -> None:
    net = make_net(rank=5)
    x = torch.randn(9, 96, dtype=torch.float64, requires_grad=True)

    def projections_one_by_one(x0):
        x = x0
        for v, w, b in zip(net.V, net.W, net.bias):
            x = x + x0 * (w(v(x)) + b)
        return x

    params = [x, *net.parameters()]
    got = net(x)
    want = projections_one_by_one(x)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(a, b)
