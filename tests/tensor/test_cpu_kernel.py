"""The fused CPU (Numba) TTM lookup against the PyTorch path, a dense reconstruction and
``gradcheck`` (float64), and its dispatch and input checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_rec.tensor import kernels
from comera_rec.tensor.contract import _gathers, ttm_dense_table, ttm_embedding_bag
from comera_rec.tensor.kernels.ttm_cpu import (
    _left_half,
    _right_half,
    pair_embedding_bag,
    ttm_embedding_bag_cpu,
)

from tests.tensor.reference import embedding_bag

ROWS, COLS = (3, 4, 2, 3), (2, 3, 2, 1)


def _cores(row_shape, col_shape, tables: int, rank: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = len(row_shape)
    full = [1] + [rank] * (d - 1) + [1]
    return [torch.randn(tables, full[k], row_shape[k], col_shape[k], full[k + 1], generator=g,
                        dtype=torch.float64).requires_grad_() for k in range(d)]


def _torch_path(*args, **kwargs) -> torch.Tensor:
    kernels.set_cpu_kernel_enabled(False)
    try:
        return ttm_embedding_bag(*args, **kwargs)
    finally:
        kernels.set_cpu_kernel_enabled(True)


def _bags(num_rows: int, tables: int, n_ids: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, (n_ids // 2,), generator=g).repeat(2)  # every id twice
    trains = torch.randint(0, tables, (n_ids,), generator=g) if tables > 1 else None
    offsets = torch.tensor([0, 0, 3, n_ids // 2, n_ids // 2, n_ids - 1, n_ids])  # empty bags too
    weights = torch.rand(n_ids, generator=g, dtype=torch.float64)
    return ids, trains, offsets, weights


@pytest.mark.parametrize("d,tables", [(2, 1), (3, 2), (4, 3)])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True), ("mean", True)])
def test_fused_equals_pytorch_path(d: int, tables: int, mode: str, weighted: bool) -> None:
    rows, cols = ROWS[:d], COLS[:d]
    cores = _cores(rows, cols, tables, rank=3, seed=d)
    ids, trains, offsets, weights = _bags(math.prod(rows), tables, 14, seed=10 + d)
    w = weights if weighted else None
    dim = math.prod(cols) - 1  # D < M: the kernel computes only the first D values
    ref = _torch_path(cores, rows, dim, ids, offsets, mode, w, trains)
    out = ttm_embedding_bag_cpu(cores, rows, dim, ids, offsets, mode, w, trains)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, cores, grad), torch.autograd.grad(ref, cores, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("many_ids", [False, True])
def test_whole_halves_and_distinct_keys_agree_with_the_dense_table(many_ids: bool) -> None:
    """Few ids contract only their distinct keys, many ids the whole halves: both equal the
    rows of the reconstructed table."""
    rows, cols = (20, 30, 25), (2, 2, 4)
    cores = _cores(rows, cols, tables=2, rank=4, seed=3)
    n = 4000 if many_ids else 6
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, math.prod(rows), (n,), generator=g)
    trains = torch.randint(0, 2, (n,), generator=g)
    prefix_keys = trains * 600 + ids // 25
    assert _gathers(cores[:2], rows[:2], prefix_keys, True, "auto") is not many_ids
    offsets = torch.arange(n + 1)
    out = ttm_embedding_bag_cpu(cores, rows, 16, ids, offsets, "sum", None, trains)
    tables = [ttm_dense_table([c.detach() for c in cores], t) for t in range(2)]
    expected = torch.stack([tables[t][i] for t, i in zip(trains.tolist(), ids.tolist())])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_each_half_is_contracted_once_per_call(monkeypatch) -> None:
    """One distinct prefix is contracted from its gathered slices, the 16 suffixes as the
    whole right half (4 x 4 indices); never once per id."""
    from comera_rec.tensor.kernels import ttm_cpu

    produced = []
    for name in ("_left_half", "_right_half"):
        original = getattr(ttm_cpu, name)
        def recording(cores, _original=original, _name=name):
            out = _original(cores)
            produced.append((_name, out.shape[0] * (out.shape[2] if _name == "_left_half" else 1)))
            return out

        monkeypatch.setattr(ttm_cpu, name, recording)
    cores = _cores((16, 16, 4, 4), (1, 2, 2, 3), tables=1, rank=3, seed=0)
    ids = torch.arange(16).repeat(3)  # 48 ids, 16 distinct rows, all with the prefix (0, 0)
    out = ttm_embedding_bag_cpu(cores, (16, 16, 4, 4), 12, ids, torch.tensor([0, 48]))
    assert produced == [("_left_half", 1), ("_right_half", 16)]  # (halves contracted, per call)
    torch.testing.assert_close(out, _torch_path(cores, (16, 16, 4, 4), 12, ids, torch.tensor([0, 48])))


def test_pair_embedding_bag_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    left = torch.randn(2, 2, 3, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)  # (A, m1, n2, m2, r)
    right = torch.randn(5, 2, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)  # (K_r, m_b, m_a, r)
    prefix = torch.tensor([0, 0, 2, 4, 5])  # non-decreasing, shared prefixes
    suffix = torch.tensor([3, 1, 3, 0, 4])  # shared suffixes
    row_of_id = torch.tensor([0, 1, 1, 4, 2, 3, 0])
    offsets = torch.tensor([0, 2, 2, 5, 7])
    weights = torch.rand(7, generator=g, dtype=torch.float64)
    for mode, w in (("sum", None), ("mean", weights)):
        torch.autograd.gradcheck(
            lambda a, b: pair_embedding_bag(a, b, prefix, suffix, row_of_id, offsets, 7, mode, w),
            (left, right),
        )


def test_results_do_not_depend_on_the_number_of_threads() -> None:
    """Threads own whole prefixes / suffixes: no atomics, so 1 and 2 threads agree bit for bit."""
    rows, cols = (20, 30, 25), (2, 2, 4)
    cores = [c.detach().float().requires_grad_() for c in _cores(rows, cols, tables=2, rank=4, seed=5)]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (3000,), generator=g)  # many shared prefixes
    trains = torch.randint(0, 2, (3000,), generator=g)
    offsets = torch.arange(0, 3001, 3)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = ttm_embedding_bag_cpu(cores, rows, 16, ids, offsets, "sum", None, trains)
            results.append([out.detach()] + list(torch.autograd.grad(out.square().sum(), cores)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@settings(max_examples=25, deadline=None)
@given(
    row_shape=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    data=st.data(),
)
def test_any_shape_and_rank_matches_the_dense_table(row_shape: list[int], data) -> None:
    d = len(row_shape)
    col_shape = data.draw(st.lists(st.integers(1, 3), min_size=d, max_size=d))
    ranks = [1] + data.draw(st.lists(st.integers(1, 4), min_size=d - 1, max_size=d - 1)) + [1]
    tables = data.draw(st.integers(1, 3))
    n = data.draw(st.integers(0, 12))
    seed = data.draw(st.integers(0, 1000))
    g = torch.Generator().manual_seed(seed)
    cores = [torch.randn(tables, ranks[k], row_shape[k], col_shape[k], ranks[k + 1], generator=g,
                         dtype=torch.float64) for k in range(d)]
    ids = torch.randint(0, math.prod(row_shape), (n,), generator=g)
    trains = torch.randint(0, tables, (n,), generator=g)
    cuts = torch.sort(torch.randint(0, n + 1, (3,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
    dim = data.draw(st.integers(1, math.prod(col_shape)))
    out = ttm_embedding_bag_cpu(cores, row_shape, dim, ids, offsets, "sum", None, trains)
    expected = torch.zeros(offsets.numel() - 1, dim, dtype=torch.float64)
    for t in range(tables):
        table = ttm_dense_table(cores, t)[:, :dim]
        expected += embedding_bag(table, ids, offsets, "sum", (trains == t).to(torch.float64))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_half_layouts_hold_the_contracted_halves() -> None:
    """The GEMM layouts the kernel reads: left (T n1, m1, n2, m2, r), right (T na nb, mb, ma, r)."""
    cores = _cores((3, 4, 2, 5), (2, 3, 2, 2), tables=2, rank=3, seed=7)
    left, right = _left_half(cores[:2]).detach(), _right_half(cores[2:]).detach()
    c = [x.detach() for x in cores]
    t, i1, i2, i3, i4 = 1, 2, 3, 1, 4
    prefix = torch.einsum("am,mbs->abs", c[0][t, 0, i1], c[1][t, :, i2])  # (m1, m2, r)
    suffix = torch.einsum("ras,sb->rab", c[2][t, :, i3], c[3][t, :, i4, :, 0])  # (r, ma, mb)
    torch.testing.assert_close(left[t * 3 + i1, :, i2], prefix)
    torch.testing.assert_close(right[(t * 2 + i3) * 5 + i4], suffix.permute(2, 1, 0))


# ------------------------------------------------------------------------------ dispatch and checks


def test_cpu_lookups_take_the_fused_kernel_unless_disabled(monkeypatch) -> None:
    calls = []
    real = kernels.ttm_embedding_bag_cpu
    monkeypatch.setattr(kernels, "ttm_embedding_bag_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    cores = _cores(ROWS[:3], COLS[:3], 1, 2, seed=0)
    ids, offsets = torch.tensor([1, 5, 7]), torch.tensor([0, 1, 3])
    ttm_embedding_bag(cores, ROWS[:3], 4, ids, offsets)
    assert calls == [1]
    monkeypatch.setenv(kernels.DISABLE_CPU_ENV, "1")
    ttm_embedding_bag(cores, ROWS[:3], 4, ids, offsets)
    assert calls == [1]
    monkeypatch.delenv(kernels.DISABLE_CPU_ENV)
    weights = torch.rand(3, dtype=torch.float64, requires_grad=True)  # weights needing a gradient
    out = ttm_embedding_bag(cores, ROWS[:3], 4, ids, offsets, "sum", weights)
    assert calls == [1]
    assert torch.autograd.grad(out.sum(), weights)[0].abs().sum() > 0


def test_bad_inputs_are_named() -> None:
    cores = _cores(ROWS[:3], COLS[:3], 2, 2, seed=0)
    offsets = torch.tensor([0, 1, 2])
    with pytest.raises(IndexError, match="id 24 out of range for a table of 24 rows"):
        ttm_embedding_bag_cpu(cores, ROWS[:3], 4, torch.tensor([0, 24]), offsets)
    with pytest.raises(IndexError, match="id -1"):
        ttm_embedding_bag_cpu(cores, ROWS[:3], 4, torch.tensor([-1, 2]), offsets)
    with pytest.raises(IndexError, match="table index 2 out of range for 2 stacked tables"):
        ttm_embedding_bag_cpu(cores, ROWS[:3], 4, torch.tensor([0, 1]), offsets, trains=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="offsets must rise from 0"):
        ttm_embedding_bag_cpu(cores, ROWS[:3], 4, torch.tensor([0, 1]), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="2 to 4 cores"):
        ttm_embedding_bag_cpu(cores[:1], ROWS[:1], 2, torch.tensor([0]), torch.tensor([0, 1]))
    left, right = torch.zeros(2, 1, 1, 1, 3), torch.zeros(2, 1, 1, 3)
    with pytest.raises(ValueError, match="prefix must be non-decreasing"):
        pair_embedding_bag(left, right, torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([0, 1]),
                           torch.tensor([0, 2]), 1)
