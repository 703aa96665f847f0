"""The fused CPU lookup of uncompressed tables with row-wise Adagrad in backward
(comera_rec/integration/rowwise_bag_cpu.cpp) against a float64 reference written with plain torch ops."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_rec.integration.rowwise_bag_kernel import (
    EXTENSION,
    RowwiseTables,
    rowwise_adagrad_bag,
    rowwise_bag_kernel_applies,
)
from comera_rec.tensor import kernels
from tests.threads import assert_bit_identical, at_thread_counts, stamps_during_call

pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py

LR, EPS = 0.05, 1e-8


@dataclass
class Case:
    """Tables laid out one after the other, and a batch of bags over them."""

    table_rows: list[int]  # per table
    table_dims: list[int]  # per table
    feature_table: list[int]  # per feature
    batch: int
    ids: torch.Tensor
    lengths: torch.Tensor  # (F * batch,)
    weights: torch.Tensor | None
    buffer: torch.Tensor
    momentum: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.long), self.lengths.cumsum(0)])

    def layout(self) -> RowwiseTables:
        starts, mstarts = [0], [0]
        for rows, dim in zip(self.table_rows, self.table_dims):
            starts.append(starts[-1] + rows * dim)
            mstarts.append(mstarts[-1] + rows)
        dims = [self.table_dims[t] for t in self.feature_table]
        dim_offset = [0]
        for d in dims:
            dim_offset.append(dim_offset[-1] + d)
        as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        return RowwiseTables(
            table_offset=as_long([starts[t] for t in self.feature_table]),
            momentum_offset=as_long([mstarts[t] for t in self.feature_table]),
            dim_offset=as_long(dim_offset),
            rows=as_long([self.table_rows[t] for t in self.feature_table]),
            feature_table=as_long(self.feature_table),
        )

    def table(self, t: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        start = sum(r * d for r, d in zip(self.table_rows[:t], self.table_dims[:t]))
        rows, dim = self.table_rows[t], self.table_dims[t]
        return (self.buffer if buffer is None else buffer)[start : start + rows * dim].view(rows, dim)


def make_case(table_rows, table_dims, feature_table, batch, max_len=3, weighted=False, seed=0, index=torch.long):
    g = torch.Generator().manual_seed(seed)
    F = len(feature_table)
    lengths = torch.randint(0, max_len + 1, (F * batch,), generator=g)
    ids = torch.cat(
        [
            torch.randint(
                0, table_rows[feature_table[f]], (int(lengths[f * batch : (f + 1) * batch].sum()),), generator=g
            )
            for f in range(F)
        ]
    ).to(index)
    weights = torch.rand(ids.numel(), generator=g) if weighted else None
    size = sum(r * d for r, d in zip(table_rows, table_dims))
    buffer = torch.randn(size, generator=g).requires_grad_()
    momentum = torch.rand(sum(table_rows), generator=g)
    return Case(list(table_rows), list(table_dims), list(feature_table), batch, ids, lengths, weights, buffer, momentum)


def reference_forward(case: Case) -> torch.Tensor:
    """Per feature, float64 rows gathered and summed bag by bag with index_add_."""
    cols = []
    bag_of = torch.repeat_interleave(torch.arange(case.lengths.numel()), case.lengths)
    for f, t in enumerate(case.feature_table):
        lo, hi = case.offsets[f * case.batch], case.offsets[(f + 1) * case.batch]
        rows = case.table(t).detach().double()[case.ids[lo:hi].long()]
        if case.weights is not None:
            rows = rows * case.weights[lo:hi].double().unsqueeze(1)
        out = torch.zeros(case.batch, case.table_dims[t], dtype=torch.float64)
        cols.append(out.index_add_(0, bag_of[lo:hi] - f * case.batch, rows))
    return torch.cat(cols, dim=1)


def reference_update(case: Case, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, momentum) after exact row-wise Adagrad, in float64: the rows' gradients
    from autograd through the reference forward, then the update row by row."""
    tables = [case.table(t).detach().double().requires_grad_() for t in range(len(case.table_rows))]
    bag_of = torch.repeat_interleave(torch.arange(case.lengths.numel()), case.lengths)
    cols = []
    for f, t in enumerate(case.feature_table):
        lo, hi = case.offsets[f * case.batch], case.offsets[(f + 1) * case.batch]
        rows = tables[t][case.ids[lo:hi].long()]
        if case.weights is not None:
            rows = rows * case.weights[lo:hi].double().unsqueeze(1)
        out = torch.zeros(case.batch, case.table_dims[t], dtype=torch.float64)
        cols.append(out.index_add(0, bag_of[lo:hi] - f * case.batch, rows))
    row_grads = torch.autograd.grad(torch.cat(cols, dim=1), tables, grad.double(), allow_unused=True)
    buffer = case.buffer.detach().double().clone()
    momentum = case.momentum.double().clone()
    mstart = 0
    for t, g in enumerate(row_grads):
        if g is not None:
            read = torch.zeros(case.table_rows[t], dtype=torch.bool)
            for f, ft in enumerate(case.feature_table):
                if ft == t:
                    lo, hi = case.offsets[f * case.batch], case.offsets[(f + 1) * case.batch]
                    read[case.ids[lo:hi].long()] = True
            m = momentum[mstart : mstart + case.table_rows[t]]
            m[read] += (g[read] ** 2).mean(1)
            step = LR / (m.sqrt() + EPS)
            table = case.table(t, buffer)
            table[read] -= step[read].unsqueeze(1) * g[read]
        mstart += case.table_rows[t]
    return buffer, momentum


def run(case: Case, grad: torch.Tensor | None = None, seed: int = 1):
    """The kernel's output, then (after backward) its buffer and momentum; the case's own
    tensors are left as they were."""
    buffer = case.buffer.detach().clone().requires_grad_()
    momentum = case.momentum.clone()
    out = rowwise_adagrad_bag(
        buffer, momentum, case.layout(), case.ids, case.offsets, case.weights, case.batch, LR, EPS
    )
    if grad is None:
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(grad)
    return out.detach(), buffer.detach(), momentum, grad


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_forward_and_update_match_the_float64_reference(weighted: bool, index: torch.dtype) -> None:
    # table 0 read by features 0 and 2 (their gradients meet in one update), dims 16 / 5 / 8
    case = make_case([40, 7, 300], [16, 5, 8], [0, 1, 0, 2], batch=9, weighted=weighted, index=index)
    out, buffer, momentum, grad = run(case)
    torch.testing.assert_close(out.double(), reference_forward(case), rtol=1e-5, atol=1e-5)
    want_buffer, want_momentum = reference_update(case, grad)
    torch.testing.assert_close(buffer.double(), want_buffer, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(momentum.double(), want_momentum, rtol=1e-5, atol=1e-7)
    assert not torch.equal(buffer, case.buffer.detach())  # something was updated
    assert case.buffer.grad is None


def test_rows_no_bag_reads_are_left_alone() -> None:
    case = make_case([50, 30], [8, 8], [0, 1], batch=4, max_len=1)
    _, buffer, momentum, _ = run(case)
    read = torch.zeros(50, dtype=torch.bool)
    read[case.ids[: int(case.lengths[:4].sum())].long()] = True
    assert torch.equal(case.table(0, buffer)[~read], case.table(0)[~read].detach())
    assert torch.equal(momentum[:50][~read], case.momentum[:50][~read])


def test_learning_rate_tensor_is_read_when_backward_runs() -> None:
    # a scheduler may set the TBE's learning-rate tensor between forward and backward
    case = make_case([20], [4], [0], batch=3, max_len=2)
    lr = torch.tensor(LR)
    buffer = case.buffer.detach().clone().requires_grad_()
    out = rowwise_adagrad_bag(buffer, case.momentum.clone(), case.layout(), case.ids, case.offsets, None, 3, lr, EPS)
    lr.fill_(0.0)
    out.sum().backward()
    assert torch.equal(buffer.detach(), case.buffer.detach())


def test_same_result_for_any_thread_count() -> None:
    case = make_case([64, 9, 500, 33], [16, 16, 16, 4], [0, 1, 2, 3, 2], batch=70, max_len=4, weighted=True)
    grad = torch.randn(70, 16 * 4 + 4)
    results = at_thread_counts(lambda: run(case, grad)[:3], [1, 2, 3])
    assert_bit_identical(results)


def test_kernel_lets_other_python_threads_run() -> None:
    def make_call(rows: int):
        case = make_case([50_000, 3_000], [16, 16], [0, 1] * 13, rows, max_len=20)
        layout, buffer, no_weights = case.layout(), case.buffer.detach(), torch.empty(0)
        args = (
            buffer,
            layout.table_offset,
            layout.dim_offset,
            layout.rows,
            case.ids,
            case.offsets,
            no_weights,
            rows,
            0,
            [],
        )
        return functools.partial(EXTENSION.load().rowwise_bag_forward, *args)

    assert stamps_during_call(make_call) > 0


@pytest.mark.parametrize("dim", [4, 16, 64])  # rows of whole vectors are pooled in registers (AVX-512: 16, 64)
def test_id_outside_its_table_is_named(dim: int) -> None:
    case = make_case([10, 20], [dim, dim], [0, 1], batch=2, max_len=1)
    case.lengths = torch.tensor([1, 1, 1, 1])
    case.ids = torch.tensor([3, 10, 5, 19])  # feature 0 reads table 0 of 10 rows: id 10 is out
    with pytest.raises(RuntimeError, match=r"id 10 of feature 0 out of range \[0, 10\)"):
        run(case)
    case.ids = torch.tensor([3, 2, -1, 19])
    with pytest.raises(RuntimeError, match=r"id -1 of feature 1 out of range \[0, 20\)"):
        run(case)


def test_inconsistent_layout_is_named() -> None:
    case = make_case([10], [4], [0], batch=2)
    with pytest.raises(RuntimeError, match="offsets for 1 features of batch 3"):
        rowwise_adagrad_bag(case.buffer, case.momentum, case.layout(), case.ids, case.offsets, None, 3, LR, EPS)


def test_applies_only_to_cpu_float32_with_kernels_on() -> None:
    w, m, ids = torch.zeros(8), torch.zeros(2), torch.zeros(1, dtype=torch.long)
    assert rowwise_bag_kernel_applies(w, m, ids)
    assert not rowwise_bag_kernel_applies(w.double(), m, ids)
    assert not rowwise_bag_kernel_applies(w, m.half(), ids)
    kernels.set_cpu_kernel_enabled(False)
    assert not rowwise_bag_kernel_applies(w, m, ids)


@given(
    # dims of whole vectors (pooled in registers: 1-8 vectors at either width) and not
    tables=st.lists(
        st.tuples(st.integers(1, 60), st.sampled_from([1, 3, 8, 16, 20, 32, 64, 128])), min_size=1, max_size=4
    ),
    extra=st.lists(st.integers(0, 3), max_size=3),
    batch=st.integers(1, 12),
    weighted=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_property_matches_the_reference(tables, extra, batch, weighted, seed) -> None:
    feature_table = list(range(len(tables))) + [e % len(tables) for e in extra]  # some tables read twice
    case = make_case([r for r, _ in tables], [d for _, d in tables], feature_table, batch, weighted=weighted, seed=seed)
    out, buffer, momentum, grad = run(case, seed=seed)
    assert out.shape == (batch, sum(tables[t][1] for t in feature_table))
    torch.testing.assert_close(out.double(), reference_forward(case), rtol=1e-5, atol=1e-5)
    want_buffer, want_momentum = reference_update(case, grad)
    torch.testing.assert_close(buffer.double(), want_buffer, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(momentum.double(), want_momentum, rtol=1e-5, atol=1e-6)


def test_bags_laid_out_in_a_wider_output_equal_the_packed_ones() -> None:
    # the features' bags at columns of the caller's choosing in a wider output (whose other
    # columns other lookups write), and the gradient read from there: the same values and
    # the same update, bit for bit
    case = make_case([40, 7, 300], [16, 5, 8], [0, 1, 0, 2], batch=9, weighted=True)
    out, buffer, momentum, grad = run(case)
    dims = case.layout().dim_offset.tolist()
    width, cols = 60, [30, 3, 10, 46]  # feature f's D_f columns from cols[f], gaps between
    laid_grad = torch.zeros(case.batch, width)
    for f, c in enumerate(cols):
        laid_grad[:, c : c + dims[f + 1] - dims[f]] = grad[:, dims[f] : dims[f + 1]]
    laid_buffer = case.buffer.detach().clone().requires_grad_()
    laid_momentum = case.momentum.clone()
    laid = rowwise_adagrad_bag(
        laid_buffer,
        laid_momentum,
        case.layout(),
        case.ids,
        case.offsets,
        case.weights,
        case.batch,
        LR,
        EPS,
        out_columns=(width, cols),
    )
    assert laid.shape == (case.batch, width)
    for f, c in enumerate(cols):
        assert torch.equal(laid[:, c : c + dims[f + 1] - dims[f]].detach(), out[:, dims[f] : dims[f + 1]])
    laid.backward(laid_grad)
    assert torch.equal(laid_buffer.detach(), buffer) and torch.equal(laid_momentum, momentum)


def test_a_bad_output_layout_is_named() -> None:
    case = make_case([40, 7], [16, 5], [0, 1], batch=3)
    with pytest.raises(RuntimeError, match="1 output columns for 2 features"):
        rowwise_adagrad_bag(
            case.buffer, case.momentum, case.layout(), case.ids, case.offsets, None, 3, LR, EPS, (40, [0])
        )
    with pytest.raises(RuntimeError, match="feature 1's columns from 30 outside rows of 32 values"):
        rowwise_adagrad_bag(
            case.buffer, case.momentum, case.layout(), case.ids, case.offsets, None, 3, LR, EPS, (32, [0, 30])
        )
