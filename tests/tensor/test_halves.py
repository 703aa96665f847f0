"""The halves' gradient layout: ``row_major_grad`` hands back row-major gradients whatever
layout the contractions after it leave them in (compared with the same gradient unwrapped)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_rec.tensor.halves import row_major_grad, row_major_strides


@st.composite
def shapes_and_orders(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    order = draw(st.permutations(range(len(shape))))
    return tuple(shape), tuple(order)


@settings(max_examples=60, deadline=None)
@given(shapes_and_orders(), st.integers(0, 2**16))
def test_gradient_is_row_major_and_unchanged_in_value(shape_order, seed: int) -> None:
    shape, order = shape_order
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(shape, generator=g, dtype=torch.float64).permute(order)

    # a permute then a product: the gradient comes back in the permuted layout
    (plain,) = torch.autograd.grad((x.permute(order) * weight).sum(), x)
    (wrapped,) = torch.autograd.grad((row_major_grad(x).permute(order) * weight).sum(), x)
    assert wrapped.stride() == torch.empty(shape).stride() == row_major_strides(shape)
    torch.testing.assert_close(wrapped, plain, rtol=0, atol=0)


def test_without_gradients_it_is_the_tensor_itself() -> None:
    x = torch.randn(2, 3)
    assert row_major_grad(x) is x
    y = torch.randn(2, 3, requires_grad=True)
    with torch.no_grad():
        assert row_major_grad(y) is y  # scoring makes no node
