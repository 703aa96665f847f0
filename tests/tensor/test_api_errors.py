"""The layers' API: a wrong argument or input fails with an error naming the argument and
what was wrong; meta inputs give meta outputs of the right shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from comera_rec import TTLinear, TTMEmbeddingBag
from comera_rec.tensor.stacked import StackedTTMTables
from comera_rec.tensor.validation import check_rank_argument

LAYERS = {
    "TTLinear": lambda rank: TTLinear(16, 8, rank=rank),
    "TTMEmbeddingBag": lambda rank: TTMEmbeddingBag(100, 16, rank=rank),
    "StackedTTMTables": lambda rank: StackedTTMTables([100, 60], 16, rank, row_shape=(10, 10), col_shape=(4, 4)),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize(
    "rank, error, message",
    [
        (4.5, TypeError, r"rank must be an int or a sequence of ints, got 4\.5 \(float\)"),
        ("4", TypeError, r"rank must be an int or a sequence of ints, got '4' \(str\)"),
        (None, TypeError, r"rank must be an int or a sequence of ints, got None \(NoneType\)"),
        (True, TypeError, r"rank must be an int or a sequence of ints, got True \(bool\)"),
        ([2.0], TypeError, r"rank\[0\] must be an int, got 2\.0 \(float\)"),
        ([], ValueError, r"rank must be an int or a non-empty sequence of ints, got an empty list"),
        (0, ValueError, r"rank must be an integer >= 1, got 0"),
        ([3, -1], ValueError, r"rank must be an integer >= 1, got -1 \(rank\[1\]\)"),
    ],
)
def test_bad_rank_names_the_argument(layer: str, rank: object, error: type, message: str) -> None:
    with pytest.raises(error, match=f"^{layer}: {message}"):
        LAYERS[layer](rank)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_integer_like_ranks_are_accepted(layer: str) -> None:
    for rank in (4, np.int64(4), torch.tensor(4)):
        assert max(LAYERS[layer](rank).ranks) == 4
    assert check_rank_argument("x", (2, np.int32(3))) == [2, 3]
    assert check_rank_argument("x", torch.tensor([2, 3])) == [2, 3]


def test_ttlinear_float64_input_to_a_float32_layer_names_both_dtypes() -> None:
    layer = TTLinear(16, 8, rank=4)
    with pytest.raises(TypeError, match=r"input dtype torch\.float64 differs from the layer's dtype torch\.float32"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"input must be floating point .*torch\.float32.*got torch\.int64"):
        layer(torch.ones(3, 16, dtype=torch.int64))
    # float64 is supported consistently: a float64 layer takes float64 input, both paths
    double = TTLinear(16, 8, rank=4, dtype=torch.float64)
    x = torch.randn(3, 16, dtype=torch.float64)
    y = double(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x @ double.dense_weight().t() + double.bias)
    assert layer.double()(x).dtype == torch.float64
    with pytest.raises(TypeError, match=r"input dtype torch\.float32 differs from the layer's dtype torch\.float64"):
        double(torch.randn(3, 16))


def test_ttlinear_under_autocast_takes_the_autocast_dtype(lookup_path: str) -> None:
    # a bfloat16 input under CPU autocast: the fused kernel takes it in float32 (and gives
    # float32); the PyTorch path runs its products, forward and backward, in bfloat16
    torch.manual_seed(0)
    layer = TTLinear(16, 8, rank=4)
    x = torch.randn(3, 16).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.shape == (3, 8)
    assert y.dtype == (torch.float32 if lookup_path == "kernel" else torch.bfloat16)
    grad = torch.randn(3, 8)
    y.backward(grad.to(y.dtype))
    reference = TTLinear(16, 8, rank=4, dtype=torch.float64)
    reference.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    want = x64 @ reference.dense_weight().t() + reference.bias  # dense reconstruction, float64
    want.backward(grad.double())
    tol = dict(rtol=1e-5, atol=1e-5) if lookup_path == "kernel" else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(y.double(), want, **tol)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=3e-2, atol=3e-2)
    for ours, theirs in zip(layer.parameters(), reference.parameters()):
        assert ours.grad.dtype == torch.float32  # autograd casts each gradient to its parameter's dtype
        torch.testing.assert_close(ours.grad.double(), theirs.grad, **tol)


def test_ttlinear_0d_input_names_the_shape() -> None:
    layer = TTLinear(16, 8, rank=4)
    with pytest.raises(ValueError, match=r"TTLinear: input must have at least 1 dimension .*0-d tensor of shape \(\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"last dimension 16, got shape \(3, 15\)"):
        layer(torch.randn(3, 15))
    with pytest.raises(TypeError, match="input must be a tensor, got list"):
        layer([1.0] * 16)
    assert layer(torch.randn(16)).shape == (8,)  # 1-D is one sample, as in nn.Linear


@pytest.mark.parametrize("shape", [(3, 16), (2, 3, 16), (16,), (0, 16)])
def test_ttlinear_on_meta_gives_meta_output_of_the_right_shape(shape: tuple[int, ...]) -> None:
    layer = TTLinear(16, 8, rank=4, device="meta")
    y = layer(torch.empty(shape, device="meta"))
    assert y.is_meta and y.shape == (*shape[:-1], 8) and y.dtype == torch.float32


def test_ttlinear_device_mismatch_names_both_devices() -> None:
    layer = TTLinear(16, 8, rank=4, device="meta")
    with pytest.raises(RuntimeError, match="TTLinear: input on cpu, the layer's parameters on meta"):
        layer(torch.randn(3, 16))


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("table_on, ids_on", [("meta", "meta"), ("meta", "cpu"), ("cpu", "meta")])
def test_ttm_bag_on_meta_gives_meta_output_of_the_right_shape(mode: str, table_on: str, ids_on: str) -> None:
    bag = TTMEmbeddingBag(2_000_000, 16, rank=4, mode=mode, device=table_on)
    ids = torch.tensor([1, 2, 1_999_999, 7], device=ids_on)
    offsets = torch.tensor([0, 2, 2, 4], device=ids_on)
    out = bag(ids, offsets)
    assert out.is_meta and out.shape == (3, 16) and out.dtype == torch.float32
    weighted = bag(ids, offsets, torch.ones(4, device=ids_on))
    assert weighted.is_meta and weighted.shape == (3, 16)
    # the checks that need no values still apply
    with pytest.raises(TypeError, match="ids must be a 1-D integer tensor, got torch.float32"):
        bag(ids.float(), offsets)
    with pytest.raises(ValueError, match=r"per_sample_weights has shape \(3,\), expected \(4,\)"):
        bag(ids, offsets, torch.ones(3, device=ids_on))
    with pytest.raises(ValueError, match="offsets must hold at least one entry"):
        bag(ids, offsets[:0])


def test_ttm_bag_meta_and_cpu_shapes_agree() -> None:
    cpu = TTMEmbeddingBag(500, 8, rank=3)
    meta = TTMEmbeddingBag(500, 8, rank=3, device="meta")
    ids, offsets = torch.tensor([4, 499, 4, 0, 3]), torch.tensor([0, 3, 3, 5])
    assert meta(ids.to("meta"), offsets.to("meta")).shape == cpu(ids, offsets).shape == (3, 8)
