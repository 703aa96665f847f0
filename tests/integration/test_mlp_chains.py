"""ChainedPerceptrons (integration/mlp.py): an MLP's runs of fused layers trained as one
kernel chain, against the same perceptrons in TorchRec's plain ``nn.Sequential``."""

import copy

import pytest
import torch
from torch import nn
from torchrec.modules.mlp import MLP

from comera_rec.integration.mlp import ChainedPerceptrons, fuse_layer_chains, fuse_narrow_layers, tt_mlp
from comera_rec.integration.torchrec_internals import mlp_layers, perceptrons, set_mlp_layers
from comera_rec.tensor import TTLinear, kernels
from comera_rec.tensor.linear import NarrowLinear

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


def bottom_mlp(dtype=torch.float32, seed=0) -> MLP:
    """DLRM's bottom MLP at small widths: NarrowLinear, two TT layers, a dense layer."""
    torch.manual_seed(seed)
    mlp = fuse_narrow_layers(tt_mlp(13, [96, 80, 64, 8], rank=8, dtype=dtype))
    with torch.no_grad():
        for p in mlp.parameters():
            p.add_(0.01 * torch.randn_like(p))  # biases and controllers off their initial values
    return mlp


def plain_copy(mlp: MLP) -> MLP:
    """The same perceptrons (copied) in TorchRec's own ``nn.Sequential``."""
    other = copy.deepcopy(mlp)
    set_mlp_layers(other, nn.Sequential(*perceptrons(other)))
    return other


def step(mlp: MLP, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    y = mlp(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *mlp.parameters()])
    return y, list(grads)


def assert_as_one_by_one(mlp: MLP, x: torch.Tensor, exact: bool = True) -> None:
    """``mlp``'s values and gradients equal its perceptrons' one by one (bit for bit with
    ``exact``)."""
    y, grads = step(mlp, x)
    want_y, want_grads = step(plain_copy(mlp), x)
    for got, want in zip([y, *grads], [want_y, *want_grads]):
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want)


def test_tt_mlp_chains_its_layers_and_keeps_torchrecs_state_dict() -> None:
    mlp = bottom_mlp()
    assert type(mlp_layers(mlp)) is ChainedPerceptrons
    kinds = [type(p._linear) for p in perceptrons(mlp)]
    assert kinds[:3] == [NarrowLinear, TTLinear, TTLinear] and kinds[3] is nn.Linear
    assert list(mlp.state_dict()) == list(plain_copy(mlp).state_dict())
    again = bottom_mlp(seed=1)
    again.load_state_dict(plain_copy(mlp).state_dict())
    x = torch.randn(10, 13)
    with torch.no_grad():
        assert torch.equal(again(x), mlp(x))


@pytest.mark.parametrize("batch", [1, 37, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_values_and_gradients_are_the_layers_one_by_one_bit_for_bit(batch, dtype) -> None:
    mlp = bottom_mlp(dtype)
    x = torch.randn(batch, 13, dtype=dtype, requires_grad=True)
    assert_as_one_by_one(mlp, x)


def test_training_takes_the_chain_for_the_run_of_fused_layers(monkeypatch) -> None:
    mlp = bottom_mlp()
    runs = []
    chain = kernels.tt_chain_cpu
    monkeypatch.setattr(kernels, "tt_chain_cpu", lambda x, layers: runs.append(len(layers)) or chain(x, layers))
    step(mlp, torch.randn(20, 13, requires_grad=True))
    assert runs == [3]  # NarrowLinear and the two TT layers; the dense layer on its own
    runs.clear()
    with torch.no_grad():  # scoring: each layer's own (packed) path
        mlp(torch.randn(20, 13))
    assert runs == []


def test_under_cpu_autocast_a_bfloat16_input_keeps_the_float32_chain(monkeypatch) -> None:
    # a bfloat16 input (a layer autocast ran before) goes through the chain in float32: the
    # values are the float32 chain's on that input, bit for bit, the dense last layer autocast's
    mlp = bottom_mlp()
    runs = []
    chain = kernels.tt_chain_cpu
    monkeypatch.setattr(
        kernels, "tt_chain_cpu", lambda x, layers: runs.append((len(layers), x.dtype)) or chain(x, layers)
    )
    x = torch.randn(20, 13).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x)
    assert runs == [(3, torch.float32)]  # NarrowLinear and the two TT layers, as in float32
    x32 = x.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = mlp(x32)
    assert y.dtype == want.dtype == torch.bfloat16  # the dense 64 -> 8 layer under autocast
    assert torch.equal(y, want)
    (gx,) = torch.autograd.grad(y.float().square().sum(), [x])
    (gx32,) = torch.autograd.grad(want.float().square().sum(), [x32])
    assert gx.dtype == torch.bfloat16 and torch.equal(gx, gx32.to(torch.bfloat16))


def test_a_relu_left_in_the_perceptron_is_chained_too() -> None:
    # compress() and hand-made MLPs keep the ReLU as the perceptron's activation
    mlp = bottom_mlp(torch.float64)
    for p in perceptrons(mlp)[1:3]:
        p._linear.relu = False
        p._activation_fn = nn.ReLU()
    x = torch.randn(50, 13, dtype=torch.float64, requires_grad=True)
    assert_as_one_by_one(mlp, x)


def test_another_activation_ends_the_run() -> None:
    mlp = bottom_mlp(torch.float64)
    perceptrons(mlp)[1]._linear.relu = False
    perceptrons(mlp)[1]._activation_fn = nn.Sigmoid()
    x = torch.randn(30, 13, dtype=torch.float64, requires_grad=True)
    assert_as_one_by_one(mlp, x, exact=False)


def test_without_the_kernels_the_same_values() -> None:
    mlp = bottom_mlp(torch.float64)
    x = torch.randn(40, 13, dtype=torch.float64, requires_grad=True)
    y, grads = step(mlp, x)
    kernels.set_cpu_kernel_enabled(False)
    off_y, off_grads = step(mlp, x)
    torch.testing.assert_close(off_y, y)
    for got, want in zip(off_grads, grads):
        torch.testing.assert_close(got, want)


def test_after_a_rank_truncation_the_chain_takes_the_new_ranks() -> None:
    mlp = bottom_mlp(torch.float64)
    for p in perceptrons(mlp):
        if isinstance(p._linear, TTLinear):
            with torch.no_grad():
                p._linear.controllers[-1][4:] = 0.0
            p._linear.truncate_ranks(1e-9)
    x = torch.randn(25, 13, dtype=torch.float64, requires_grad=True)
    assert_as_one_by_one(mlp, x)


def test_bad_input_gets_the_layers_own_error() -> None:
    mlp = bottom_mlp()
    with pytest.raises(ValueError, match=r"NarrowLinear: expected input with last dimension 13, got shape \(4, 12\)"):
        mlp(torch.randn(4, 12, requires_grad=True))


def test_fuse_layer_chains_keeps_a_plain_mlp_as_it_computes() -> None:
    torch.manual_seed(0)
    mlp = MLP(6, [5, 4])
    x = torch.randn(3, 6)
    want = mlp(x)
    assert fuse_layer_chains(mlp) is mlp and type(mlp_layers(mlp)) is ChainedPerceptrons
    assert torch.equal(mlp(x), want)
    assert fuse_layer_chains(mlp) is mlp  # again: nothing changes


def test_compress_chains_the_tt_layers_of_a_torchrec_mlp() -> None:
    from comera_rec.integration.compress import compress
    from comera_rec.integration.policy import CompressionPolicy

    torch.manual_seed(0)
    holder = nn.Module()
    holder.mlp = MLP(64, [128, 96, 4])
    names = list(holder.state_dict())
    x = torch.randn(20, 64, requires_grad=True)
    compress(holder, CompressionPolicy(rank=8))
    assert sum(isinstance(p._linear, TTLinear) for p in perceptrons(holder.mlp)) >= 2
    assert type(mlp_layers(holder.mlp)) is ChainedPerceptrons
    # the perceptrons' names are TorchRec's (a TT layer holds cores where the weight was)
    assert {n.split("._linear")[0] for n in holder.state_dict()} == {n.split("._linear")[0] for n in names}
    assert_as_one_by_one(holder.mlp, x)


def test_unchain_layers_gives_torchrecs_sequential_back() -> None:
    from comera_rec.integration.mlp import unchain_layers

    mlp = bottom_mlp()
    x = torch.randn(30, 13, requires_grad=True)
    y, grads = step(mlp, x)
    assert unchain_layers(mlp) is mlp and type(mlp_layers(mlp)) is nn.Sequential
    y2, grads2 = step(mlp, x)
    assert torch.equal(y, y2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    assert type(mlp_layers(fuse_layer_chains(mlp))) is ChainedPerceptrons


def test_a_run_ends_where_its_weights_would_outgrow_the_cache(monkeypatch) -> None:
    torch.manual_seed(0)
    mlp = tt_mlp(64, [96, 80, 64, 48], rank=8, min_gain=1.0)
    assert all(isinstance(p._linear, TTLinear) for p in perceptrons(mlp))
    sizes = [kernels.chain_bytes(*p._linear.chain_operands(torch.randn(2, 2))[:2]) for p in perceptrons(mlp)]
    runs = []
    chain = kernels.tt_chain_cpu
    monkeypatch.setattr(kernels, "tt_chain_cpu", lambda x, layers: runs.append(len(layers)) or chain(x, layers))
    x = torch.randn(40, 64, requires_grad=True)
    monkeypatch.setattr(kernels, "chain_fits", lambda b: b <= sum(sizes[:2]))  # two layers fit, not three
    assert_as_one_by_one(mlp, x)
    assert runs == [2, 2]
    runs.clear()
    monkeypatch.setattr(kernels, "chain_fits", lambda b: b <= sizes[0] // 2)  # not even one: each on its own
    assert_as_one_by_one(mlp, x)
    assert runs == []


def test_a_layer_the_kernel_does_not_take_is_not_merged_for_nothing(monkeypatch) -> None:
    # float64 takes ranks up to 32: a rank-40 layer runs its own (BLAS) path, unmerged here
    layer = TTLinear(64, 64, rank=40, dtype=torch.float64)
    assert layer.chains()[0].shape[1] == 40
    merges = []
    merged = layer._merged_chains
    monkeypatch.setattr(layer, "_merged_chains", lambda: merges.append(1) or merged())
    assert layer.chain_operands(torch.randn(2, 64, dtype=torch.float64)) is None
    assert merges == []
    assert layer.chain_operands(torch.randn(2, 64, dtype=torch.float32)) is None  # another dtype
    assert merges == []
    small = TTLinear(64, 64, rank=8, dtype=torch.float64)
    left, right, bias, relu = small.chain_operands(torch.randn(2, 64, dtype=torch.float64))
    assert left.shape == (64, 8) and right.shape == (8, 64) and bias is small.bias and relu is False
