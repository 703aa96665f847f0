"""The fused CPU chain of TT linears (``tt_chain_forward`` / ``tt_chain_backward`` in
kernels/tt_linear_cpu.cpp): bit for bit the single-layer kernel layer after layer, and a
float64 reference through dense GEMMs and autograd."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_rec.tensor import kernels
from tests.threads import assert_bit_identical, at_thread_counts

DT = torch.float64

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


def make_chain(batch, widths, ranks, relus, biases=None, dtype=DT, seed=0):
    """An input ``(batch, widths[0])`` and layers ``(left, right, bias, relu)``, all needing
    gradients; layer k maps widths[k] -> widths[k + 1] at rank ranks[k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, widths[0], generator=g, dtype=dtype).requires_grad_()
    layers = []
    for k, rank in enumerate(ranks):
        n_in, n_out = widths[k], widths[k + 1]
        left = (torch.randn(n_in, rank, generator=g, dtype=dtype) / n_in**0.5).requires_grad_()
        right = (torch.randn(rank, n_out, generator=g, dtype=dtype) / rank**0.5).requires_grad_()
        has_bias = True if biases is None else biases[k]
        bias = torch.randn(n_out, generator=g, dtype=dtype).requires_grad_() if has_bias else None
        layers.append((left, right, bias, relus[k]))
    return x, layers


def one_by_one(x, layers):
    """The single-layer kernel layer after layer."""
    for layer in layers:
        x = kernels.tt_linear_cpu(x, *layer)
    return x


def reference(x, layers):
    """The chain in float64 through dense weights and autograd's own ReLU."""
    h = x.double()
    for left, right, bias, relu in layers:
        h = h @ (left.double() @ right.double())
        if bias is not None:
            h = h + bias.double()
        if relu:
            h = torch.relu(h)
    return h


def inputs_of(x, layers):
    return [x] + [t for left, right, bias, _ in layers for t in (left, right, bias) if t is not None]


def grads(y, inputs, g):
    wanted = [t for t in inputs if t.requires_grad]
    return torch.autograd.grad(y, wanted, g.to(y.dtype))


# (batch, widths, ranks, ReLUs): one layer; DLRM's bottom (13 -> 512 -> 256, the first an
# identity left of 13) and top MLP (367 -> 512 -> 256); batches not whole tiles (8 / 12
# rows) nor whole backward blocks (64 / 96) nor whole row chunks; widths not whole
# vectors; odd ranks; a last layer without its ReLU
CASES = [
    (5, [7, 9], [3], [True]),
    (300, [13, 512, 256], [13, 32], [True, True]),
    (700, [367, 512, 256], [32, 32], [True, True]),
    (37, [40, 84, 29, 17], [5, 31, 17], [True, False, True]),
    (130, [33, 70, 70, 1], [24, 32, 1], [True, True, False]),
]


@pytest.mark.parametrize("batch,widths,ranks,relus", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, DT])
def test_chain_is_the_single_layer_kernel_bit_for_bit(batch, widths, ranks, relus, dtype) -> None:
    x, layers = make_chain(batch, widths, ranks, relus, dtype=dtype)
    assert kernels.tt_chain_kernel_applies(x, [(left, right) for left, right, _, _ in layers])
    y = kernels.tt_chain_cpu(x, layers)
    want = one_by_one(x, layers)
    assert torch.equal(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    params = inputs_of(x, layers)
    for got, ref in zip(grads(y, params, g), grads(want, params, g)):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("batch,widths,ranks,relus", CASES)
def test_chain_equals_the_float64_reference(batch, widths, ranks, relus) -> None:
    x, layers = make_chain(batch, widths, ranks, relus)
    y = kernels.tt_chain_cpu(x, layers)
    want = reference(x, layers)
    torch.testing.assert_close(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    params = inputs_of(x, layers)
    for got, ref in zip(grads(y, params, g), grads(want, params, g)):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("rank", [40, 64])
def test_float32_at_the_largest_ranks_against_float64(rank: int) -> None:
    x, layers = make_chain(300, [96, 80, 50], [rank, rank], [True, True], dtype=torch.float32)
    y = kernels.tt_chain_cpu(x, layers)
    assert torch.equal(y, one_by_one(x, layers))
    torch.testing.assert_close(y.double(), reference(x, layers), rtol=1e-5, atol=1e-5)


def test_gradcheck() -> None:
    x, layers = make_chain(9, [6, 7, 5], [3, 2], [True, False], biases=[True, False])
    with torch.no_grad():
        x += 0.5  # pre-activations away from the ReLU's kink

    def chain(x, l0, r0, b0, l1, r1):
        return kernels.tt_chain_cpu(x, [(l0, r0, b0, True), (l1, r1, None, False)])

    (l0, r0, b0, _), (l1, r1, _, _) = layers
    assert torch.autograd.gradcheck(chain, (x, l0, r0, b0, l1, r1))


def test_constant_lefts_and_a_constant_input_get_no_gradient() -> None:
    # NarrowLinear's identity left needs no gradient, nor does the batch's input
    x, layers = make_chain(45, [12, 30, 20], [12, 6], [True, True])
    x.requires_grad_(False)
    layers[0] = (torch.eye(12, dtype=DT), *layers[0][1:])
    y = kernels.tt_chain_cpu(x, layers)
    want = reference(x, layers)
    params = inputs_of(x, layers)
    g = torch.randn_like(y)
    for got, ref in zip(grads(y, params, g), grads(want, params, g)):
        torch.testing.assert_close(got, ref)


def test_without_gradients_the_values_are_the_same() -> None:
    x, layers = make_chain(50, [20, 30, 10], [4, 8], [True, True])
    recorded = kernels.tt_chain_cpu(x, layers)
    assert recorded.grad_fn is not None
    with torch.no_grad():
        plain = kernels.tt_chain_cpu(x, layers)
    assert plain.grad_fn is None and torch.equal(plain, recorded)


@pytest.mark.parametrize("threads", [2, 3])
def test_thread_counts_give_identical_results(threads: int) -> None:
    x, layers = make_chain(1000, [40, 24, 30], [9, 16], [True, True], dtype=torch.float32)

    def run():
        y = kernels.tt_chain_cpu(x, layers)
        return [y, *torch.autograd.grad(y.square().sum(), inputs_of(x, layers))]

    assert_bit_identical(at_thread_counts(run, (1, threads)))


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 150),
    widths=st.lists(st.integers(1, 40), min_size=2, max_size=5),
    data=st.data(),
    seed=st.integers(0, 10_000),
)
def test_property_shapes_and_ranks(batch, widths, data, seed) -> None:
    layers_count = len(widths) - 1
    ranks = data.draw(st.lists(st.integers(1, 32), min_size=layers_count, max_size=layers_count))
    relus = data.draw(st.lists(st.booleans(), min_size=layers_count, max_size=layers_count))
    biases = data.draw(st.lists(st.booleans(), min_size=layers_count, max_size=layers_count))
    x, layers = make_chain(batch, widths, ranks, relus, biases=biases, seed=seed)
    y = kernels.tt_chain_cpu(x, layers)
    assert y.shape == (batch, widths[-1])
    want = reference(x, layers)
    torch.testing.assert_close(y, want)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=DT)
    params = inputs_of(x, layers)
    for got, ref in zip(grads(y, params, g), grads(want, params, g)):
        torch.testing.assert_close(got, ref)


def test_applies_only_to_a_chain_of_matching_widths() -> None:
    x, layers = make_chain(4, [6, 5, 3], [2, 2], [True, True], dtype=torch.float32)
    pairs = [(left, right) for left, right, _, _ in layers]
    assert kernels.tt_chain_kernel_applies(x, pairs)
    assert not kernels.tt_chain_kernel_applies(x, [])
    assert not kernels.tt_chain_kernel_applies(x, pairs[::-1])  # 5 inputs after 3 outputs
    assert not kernels.tt_chain_kernel_applies(x.double(), pairs)  # another dtype


def test_bad_inputs_name_what_was_wrong() -> None:
    x, layers = make_chain(4, [6, 5, 3], [2, 2], [True, True])
    (l0, r0, b0, _), (l1, r1, b1, _) = layers
    with pytest.raises(RuntimeError, match="left has 4 rows for 5 input features"):
        kernels.tt_chain_cpu(x, [(l0, r0, b0, True), (torch.randn(4, 2, dtype=DT), r1, b1, True)])
    with pytest.raises(RuntimeError, match="bias of 2 values for 3 outputs"):
        kernels.tt_chain_cpu(x, [(l0, r0, b0, True), (l1, r1, torch.randn(2, dtype=DT), True)])
    with pytest.raises(RuntimeError, match="x must be a matrix"):
        kernels.tt_chain_cpu(x[0], layers)
    with pytest.raises(RuntimeError, match="at least one layer"):
        kernels.tt_chain_cpu(x, [])


def test_the_backward_names_a_saved_output_of_another_shape() -> None:
    from comera_rec.tensor.kernels.cpu_extension import extension

    x, layers = make_chain(4, [6, 5, 3], [2, 2], [True, True])
    lefts, rights, biases = ([layer[i] for layer in layers] for i in range(3))
    y, *ts = extension().tt_chain_forward(x, lefts, rights, biases, [True, True])
    with pytest.raises(RuntimeError, match=r"the forward's output has shape \[4, 2\] for a gradient of \[4, 3\]"):
        extension().tt_chain_backward(
            torch.ones_like(y), x, lefts, rights, biases, [True, True], ts, y[:, :2], True, [True] * 2, [True] * 2
        )
    with pytest.raises(RuntimeError, match="saved t has shape"):
        extension().tt_chain_backward(
            torch.ones_like(y),
            x,
            lefts,
            rights,
            biases,
            [True, True],
            [ts[0][:3], ts[1]],
            y,
            True,
            [True] * 2,
            [True] * 2,
        )


def test_the_l2_size_is_read_from_sysfs_or_defaults(tmp_path, monkeypatch) -> None:
    import importlib

    tt_linear_cpu = importlib.import_module("comera_rec.tensor.kernels.tt_linear_cpu")  # the module, not the function
    for name, level, kind, size in (
        ("index0", 1, "Data", "48K"),
        ("index1", 1, "Instruction", "32K"),
        ("index2", 2, "Unified", "2048K"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(f"{level}\n")
        (tmp_path / name / "type").write_text(f"{kind}\n")
        (tmp_path / name / "size").write_text(f"{size}\n")
    monkeypatch.setattr(tt_linear_cpu, "_CACHE_DIR", tmp_path)
    tt_linear_cpu.l2_cache_bytes.cache_clear()
    try:
        assert tt_linear_cpu.l2_cache_bytes() == 2 << 20
        assert tt_linear_cpu.chain_fits(1 << 20) and not tt_linear_cpu.chain_fits((1 << 20) + 1)
        monkeypatch.setattr(tt_linear_cpu, "_CACHE_DIR", tmp_path / "missing")
        tt_linear_cpu.l2_cache_bytes.cache_clear()
        assert tt_linear_cpu.l2_cache_bytes() == 1 << 20
    finally:
        tt_linear_cpu.l2_cache_bytes.cache_clear()
    left, right = torch.zeros(10, 4), torch.zeros(4, 6)
    assert tt_linear_cpu.chain_bytes(left, right) == 2 * (40 + 24) * 4
