"""The fused CPU TTM lookup (kernels/ttm_cpu.cpp) against the PyTorch path and dense tables."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera_rec.tensor import kernels
from comera_rec.tensor.contract import ttm_dense_table, ttm_embedding_bag
from tests.threads import assert_bit_identical, at_thread_counts

DT = torch.float64


pytestmark = pytest.mark.usefixtures("kernels_on")  # tests/conftest.py


def make_cores(tables, rows, cols, ranks, dtype=DT, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = [1, *ranks, 1]
    return [
        (
            torch.randn(tables, full[k], rows[k], cols[k], full[k + 1], generator=g, dtype=dtype) / math.sqrt(full[k])
        ).requires_grad_()
        for k in range(len(rows))
    ]


def make_batch(tables, num_rows, n_ids=60, seed=0, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, (n_ids // 3,), generator=g).repeat(3)  # repeats: de-duplication matters
    ids = ids[torch.randperm(n_ids, generator=g)]
    trains = torch.randint(0, tables, (n_ids,), generator=g)
    cuts = torch.sort(torch.randint(0, n_ids + 1, (8,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n_ids])])  # some bags empty
    weights = torch.rand(n_ids, generator=g, dtype=dtype).requires_grad_()
    return ids, trains, offsets, weights


def lookup(cores, rows, dim, ids, offsets, mode, weights, trains, kernel: bool):
    kernels.set_cpu_kernel_enabled(kernel)
    try:
        return ttm_embedding_bag(cores, rows, dim, ids, offsets, mode, weights, trains)
    finally:
        kernels.set_cpu_kernel_enabled(True)


# ranks 5 and 17: not whole vectors (padded inside the kernel), 17 spans two
SHAPES = [
    ((7, 9), (3, 4), [5]),  # 1-core halves
    ((5, 6, 7), (2, 2, 3), [4, 17]),  # 2-core left, 1-core right
    ((4, 5, 6, 3), (2, 3, 2, 2), [3, 17, 5]),  # 2-core halves
    ((6, 5, 4, 7), (2, 2, 2, 2), [16, 16, 16]),  # the Kaggle DLRM's factors at rank 16
]


@pytest.mark.parametrize("rows, cols, ranks", SHAPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_values_and_gradients_equal_the_torch_path(rows, cols, ranks, mode, weighted) -> None:
    cores = make_cores(3, rows, cols, ranks)
    ids, trains, offsets, weights = make_batch(3, math.prod(rows))
    weights = weights if weighted else None
    dim = math.prod(cols) - 1  # a padded column is dropped
    inputs = cores + ([weights] if weighted else [])
    got = lookup(cores, rows, dim, ids, offsets, mode, weights, trains, kernel=True)
    want = lookup(cores, rows, dim, ids, offsets, mode, weights, trains, kernel=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows, cols, ranks", SHAPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_repeated_rows_equal_the_torch_path(rows, cols, ranks, weighted) -> None:
    # The backward runs its per-row products once per distinct (table, id) on the sum of
    # its ids' gradients: a skewed batch, one hot row in every bag (twice in some), others
    # shared between tables and bags.
    cores = make_cores(2, rows, cols, ranks)
    g = torch.Generator().manual_seed(3)
    hot = [0, math.prod(rows) - 1, 5]
    ids = torch.tensor(hot)[torch.randint(0, 3, (40,), generator=g)]
    ids[::7] = torch.randint(0, math.prod(rows), (6,), generator=g)
    trains = (torch.arange(40) % 5 == 0).long()
    offsets = torch.tensor([0, 2, 2, 9, 20, 21, 33, 40])
    weights = torch.rand(40, generator=g, dtype=DT).requires_grad_() if weighted else None
    dim = math.prod(cols)
    inputs = cores + ([weights] if weighted else [])
    got = lookup(cores, rows, dim, ids, offsets, "sum", weights, trains, kernel=True)
    want = lookup(cores, rows, dim, ids, offsets, "sum", weights, trains, kernel=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# float32 runs whole 16-lane vectors (float64 runs 8); a 4 x 4 row of 16 floats is pooled
# as one vector (kernels/ttm_cpu.cpp, pool_one_vector): ranks of one, two and (padded) three vectors
@pytest.mark.parametrize(
    "rows, cols, ranks",
    [
        ((6, 5, 4, 7), (2, 2, 2, 2), [16, 16, 16]),
        ((6, 5, 4, 7), (2, 2, 2, 2), [32, 32, 32]),
        ((30, 27), (4, 4), [40]),
        ((6, 5, 4), (2, 2, 4), [8, 24]),
    ],
)
def test_rows_equal_the_dense_tables_in_float32(rows, cols, ranks) -> None:
    cores64 = make_cores(2, rows, cols, ranks)
    cores32 = [c.detach().float().requires_grad_() for c in cores64]
    ids = torch.arange(math.prod(rows)).repeat(2)
    trains = torch.arange(2).repeat_interleave(math.prod(rows))
    offsets = torch.arange(ids.numel() + 1)
    out = ttm_embedding_bag(cores32, rows, 16, ids, offsets, "sum", None, trains)
    want = torch.cat([ttm_dense_table([c.detach() for c in cores64], t) for t in range(2)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_gradcheck() -> None:
    cores = make_cores(2, (2, 3, 2), (2, 1, 2), [3, 2])
    ids = torch.tensor([0, 11, 11, 4, 7, 2])
    trains = torch.tensor([0, 1, 1, 0, 1, 0])
    offsets = torch.tensor([0, 2, 2, 6])
    weights = torch.rand(6, dtype=DT, requires_grad=True)

    def fn(c0, c1, c2, w):
        return ttm_embedding_bag([c0, c1, c2], (2, 3, 2), 4, ids, offsets, "mean", w, trains)

    assert torch.autograd.gradcheck(fn, (*cores, weights))


@pytest.mark.parametrize("threads", [2, 3])
def test_thread_counts_give_identical_results(threads: int) -> None:
    # every sum has one owner thread and a fixed order: bit-identical for any thread count
    # (a run resumed with another thread count continues exactly)
    rows, cols, ranks = (5, 6, 7, 4), (2, 2, 2, 2), [6, 9, 4]
    cores = make_cores(2, rows, cols, ranks)
    ids, trains, offsets, _ = make_batch(2, math.prod(rows), n_ids=300)

    def run():
        out = ttm_embedding_bag(cores, rows, 16, ids, offsets, "sum", None, trains)
        return [out, *torch.autograd.grad(out.square().sum(), cores)]

    assert_bit_identical(at_thread_counts(run, (1, threads)))


@given(
    d=st.integers(2, 4),
    rank=st.integers(1, 20),
    tables=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_property_rows_equal_dense_reconstruction(d, rank, tables, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = [int(v) for v in torch.randint(1, 5, (d,), generator=g)]
    cols = [int(v) for v in torch.randint(1, 4, (d,), generator=g)]
    ranks = [int(v) for v in torch.randint(1, rank + 1, (d - 1,), generator=g)]
    cores = make_cores(tables, rows, cols, ranks, seed=seed)
    n = math.prod(rows)
    ids = torch.randint(0, n, (9,), generator=g)
    trains = torch.randint(0, tables, (9,), generator=g)
    dim = math.prod(cols)
    out = ttm_embedding_bag(cores, rows, dim, ids, torch.arange(10), "sum", None, trains)
    dense = [ttm_dense_table([c.detach() for c in cores], t) for t in range(tables)]
    want = torch.stack([dense[int(t)][int(i)] for t, i in zip(trains, ids)])
    torch.testing.assert_close(out, want)


@given(
    d=st.integers(2, 4),
    ranks=st.lists(st.sampled_from([1, 3, 8, 16, 17, 33]), min_size=3, max_size=3),
    tables=st.integers(1, 3),
    n_ids=st.integers(1, 40),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_property_bags_and_gradients_equal_the_torch_path(d, ranks, tables, n_ids, mode, weighted, seed) -> None:
    # ranks at, below and across whole vectors; bags of any length, some empty; repeated ids
    g = torch.Generator().manual_seed(seed)
    rows = [int(v) for v in torch.randint(1, 7, (d,), generator=g)]
    cols = [int(v) for v in torch.randint(1, 4, (d,), generator=g)]
    cores = make_cores(tables, rows, cols, ranks[: d - 1], seed=seed)
    ids = torch.randint(0, math.prod(rows), (n_ids,), generator=g) % max(1, math.prod(rows) // 2)
    trains = torch.randint(0, tables, (n_ids,), generator=g)
    cuts = torch.sort(torch.randint(0, n_ids + 1, (5,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n_ids])])
    weights = torch.rand(n_ids, generator=g, dtype=DT).requires_grad_() if weighted else None
    dim = math.prod(cols)
    inputs = cores + ([weights] if weighted else [])
    got = lookup(cores, rows, dim, ids, offsets, mode, weights, trains, kernel=True)
    want = lookup(cores, rows, dim, ids, offsets, mode, weights, trains, kernel=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn(got.shape, generator=g, dtype=DT)
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_out_of_range_ids_and_tables_name_the_value() -> None:
    cores = make_cores(2, (3, 4), (2, 2), [2])
    offsets = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match=r"id 12 out of range \[0, 12\)"):
        ttm_embedding_bag(cores, (3, 4), 4, torch.tensor([1, 12]), offsets, trains=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"table index 2 out of range \[0, 2\)"):
        ttm_embedding_bag(cores, (3, 4), 4, torch.tensor([1, 2]), offsets, trains=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"row_shape \(4, 3\) does not match the cores' \(3, 4\)"):
        ttm_embedding_bag(cores, (4, 3), 4, torch.tensor([1, 2]), offsets, trains=torch.tensor([0, 1]))


def test_dispatch_switches(monkeypatch) -> None:
    cores = make_cores(1, (3, 4), (2, 2), [2])
    ids = torch.tensor([1, 2])
    assert kernels.cpu_kernel_applies(cores, ids)
    assert not kernels.cpu_kernel_applies([c.to("meta") for c in cores], ids.to("meta"))
    assert not kernels.cpu_kernel_applies([c.half() for c in cores], ids)
    monkeypatch.setenv(kernels.ttm_cpu.DISABLE_ENV, "1")
    assert not kernels.cpu_kernel_applies(cores, ids)
    monkeypatch.setenv(kernels.ttm_cpu.DISABLE_ENV, "0")
    kernels.set_cpu_kernel_enabled(False)
    assert not kernels.cpu_kernel_applies(cores, ids)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_check_jagged_finds_the_first_problem(dtype) -> None:
    # 3 keys x batch 2; key 1 unchecked (bound -1)
    values = torch.tensor([0, 4, 1, 99, -5, 2, 2], dtype=dtype)
    lengths = torch.tensor([1, 1, 1, 2, 0, 2])
    assert kernels.check_jagged(values, lengths, None, 2, [5, -1, 3]) == (0, -1, 7, -1)
    assert kernels.check_jagged(values, lengths, None, 2, [4, -1, 3]) == (3, 1, 7, 0)  # 4 >= 4
    assert kernels.check_jagged(values, lengths, None, 2, [5, 50, 3]) == (3, 3, 7, 1)  # 99 of key 1
    assert kernels.check_jagged(values, lengths, None, 2, [5, -1, 2]) == (3, 5, 7, 2)  # 2 >= 2 in key 2
    assert kernels.check_jagged(values, torch.tensor([1, 1, -1, 2, 0, 2]), None, 2, [5, -1, 3])[:2] == (1, 2)
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 7])  # bag 3 holds 1 id, lengths say 2
    assert kernels.check_jagged(values, lengths, offsets, 2, [5, -1, 3])[:2] == (2, 3)
    assert kernels.check_jagged(values[:0], torch.zeros(6, dtype=torch.long), None, 2, [1, 1, 1]) == (0, -1, 0, -1)


# ---------------------------------------------------------------------------- scoring over whole halves


def score(cores, rows, dim, ids, offsets, mode, weights, trains, stream_batch=0):
    """The lookup with gradients off inside ``cached_weights``: over the kept whole halves."""
    from comera_rec.tensor import cached_weights

    with torch.no_grad(), cached_weights():
        return kernels.ttm_embedding_bag_cpu(
            cores, rows, dim, ids, offsets, mode, weights, trains, stream_batch=stream_batch
        ), len(kernels.ttm_cpu._HALVES)


@pytest.mark.parametrize("rows, cols, ranks", SHAPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_scoring_over_whole_halves_equals_the_lookup(rows, cols, ranks, mode, weighted) -> None:
    tables = 3
    cores = make_cores(tables, rows, cols, ranks)
    ids, trains, offsets, weights = make_batch(tables, math.prod(rows), n_ids=63)
    w = weights.detach() if weighted else None
    dim = math.prod(cols) - 1
    want = lookup(cores, rows, dim, ids, offsets, mode, w, trains, kernel=True).detach()
    got, kept = score(cores, rows, dim, ids, offsets, mode, w, trains)
    assert kept == 1  # the halves were made and used
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same per-id products, in the same order
    # the bags as (batch, streams * dim): 9 bags = 3 streams of 3
    by_streams = lookup(cores, rows, dim, ids, offsets, mode, w, trains, kernel=False).detach()
    got, _ = score(cores, rows, dim, ids, offsets, mode, w, trains, stream_batch=3)
    torch.testing.assert_close(got, by_streams.view(3, 3, dim).transpose(0, 1).reshape(3, 3 * dim))


# float32 rows are pooled W dot products at a time (pool_row_vectors), a last group of
# fewer one by one: column counts below, at and past a vector's width, rows of a half's
# columns that do not fill whole vectors (45 = 3 x 15), MLPerf's 128
F32_SHAPES = [*SHAPES, ((4, 5, 6), (3, 5, 3), [8, 8]), ((5, 6, 7), (4, 4, 8), [16, 16])]


@pytest.mark.parametrize("rows, cols, ranks", F32_SHAPES)
@pytest.mark.parametrize("dropped", [0, 1, 5])
def test_float32_pooling_equals_float64_products(rows, cols, ranks, dropped) -> None:
    cores = [c.detach() for c in make_cores(3, rows, cols, ranks, dtype=torch.float32)]
    ids, trains, offsets, weights = make_batch(3, math.prod(rows), n_ids=63, dtype=torch.float32)
    weights = weights.detach()
    dim = math.prod(cols) - dropped
    want = lookup([c.double() for c in cores], rows, dim, ids, offsets, "sum", weights.double(), trains, kernel=False)
    got = lookup(cores, rows, dim, ids, offsets, "sum", weights, trains, kernel=True)  # halves of the batch's rows
    scored, kept = score(cores, rows, dim, ids, offsets, "sum", weights, trains)  # whole halves
    assert kept == 1 and got.dtype == scored.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scored.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, cols, ranks", SHAPES)
def test_whole_halves_equal_the_halves_contracted_by_torch(rows, cols, ranks) -> None:
    from comera_rec.tensor.halves import left_table, right_table, split_point

    cores = [c.detach() for c in make_cores(2, rows, cols, ranks)]
    h, r = split_point(len(cores)), ranks[(len(rows) + 1) // 2 - 1]
    prefixes, suffixes = kernels.ttm_cpu.extension().ttm_halves(cores)
    assert prefixes.nbytes + suffixes.nbytes == kernels.ttm_cpu.whole_halves_bytes(cores)
    torch.testing.assert_close(prefixes[..., :r], left_table(cores[:h]))
    right = right_table(cores[h:])  # (T N_r, m_b, r, m_a)
    torch.testing.assert_close(suffixes[..., :r], right.permute(0, 3, 1, 2).reshape(suffixes.shape[0], -1, r))
    assert not prefixes[..., r:].any() and not suffixes[..., r:].any()  # rank padding stays zero


def test_whole_halves_only_when_scoring_within_the_budget(monkeypatch) -> None:
    from comera_rec.tensor import cached_weights

    rows, cols, ranks = SHAPES[2]
    cores = make_cores(2, rows, cols, ranks)
    ids, trains, offsets, _ = make_batch(2, math.prod(rows))
    with cached_weights():  # gradients on: the per-batch lookup, nothing kept
        out = kernels.ttm_embedding_bag_cpu(cores, rows, 4, ids, offsets, trains=trains)
        assert out.requires_grad and len(kernels.ttm_cpu._HALVES) == 0
    monkeypatch.setattr(kernels.ttm_cpu, "WHOLE_HALVES_MAX_BYTES", kernels.ttm_cpu.whole_halves_bytes(cores) - 1)
    got, kept = score(cores, rows, 4, ids, offsets, "sum", None, trains)
    assert kept == 0
    torch.testing.assert_close(got, out.detach(), rtol=0, atol=0)


def test_whole_halves_lookup_names_bad_ids_and_shapes() -> None:
    cores = make_cores(2, (3, 4), (2, 2), [2])
    offsets = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match=r"id 12 out of range \[0, 12\)"):
        score(cores, (3, 4), 4, torch.tensor([1, 12]), offsets, "sum", None, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"table index 2 out of range \[0, 2\)"):
        score(cores, (3, 4), 4, torch.tensor([1, 2]), offsets, "sum", None, torch.tensor([0, 2]))
    prefixes, suffixes = kernels.ttm_cpu.extension().ttm_halves([c.detach() for c in cores])
    with pytest.raises(RuntimeError, match="are not 2 tables with 5 suffixes"):
        kernels.ttm_cpu.extension().ttm_bag_forward_halves(
            prefixes, suffixes, torch.tensor([1]), torch.tensor([0]), torch.tensor([0, 1]), torch.empty(0), 4, 0, 2, 5
        )


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_module_scoring_finds_its_kept_halves(kernels_on, monkeypatch, mode) -> None:
    """``TTMEmbeddingBag`` keeps its whole halves on its own parameters while scoring: made
    once over several calls (before, a fresh view per call missed them every time), again
    after a write; the controller-folded cores are not kept beside them."""
    from comera_rec.tensor import TTMEmbeddingBag, cached_weights
    from comera_rec.tensor.derived import derived_cache

    torch.manual_seed(0)
    table = TTMEmbeddingBag(3000, 8, rank=4, mode=mode)
    with torch.no_grad():
        for c in table.controllers:
            c.uniform_(0.5, 1.5)  # a controller left out of the halves would show
    ids, offsets = torch.randint(0, 3000, (40,)), torch.arange(0, 41, 4)
    want = table(ids, offsets).detach()
    made: list[int] = []
    ext = kernels.ttm_cpu.extension()

    class Counting:
        def __getattr__(self, name):
            if name == "ttm_halves":
                made.append(1)
            return getattr(ext, name)

    monkeypatch.setattr(kernels.ttm_cpu, "extension", lambda: Counting())
    with torch.no_grad(), cached_weights():
        for _ in range(3):
            torch.testing.assert_close(table(ids, offsets), want, rtol=1e-5, atol=1e-6)
        assert len(made) == 1
        assert derived_cache(table, "whole_halves").peek(table.train_tensors()) is not None
        assert derived_cache(table, "stacked_cores").is_empty() and derived_cache(table, "scaled_cores").is_empty()
        assert kernels.ttm_cpu._HALVES.is_empty()  # nothing kept on folded copies in the shared cache
        table.cores[1].mul_(2.0)  # an in-place write: made again, and the scores follow it
        changed = table(ids, offsets)
        assert not torch.allclose(changed, want)
        assert len(made) == 2
    with torch.no_grad():
        torch.testing.assert_close(changed, table(ids, offsets), rtol=1e-5, atol=1e-6)


def test_stacked_tables_keep_their_halves_on_the_parameters(kernels_on) -> None:
    """Scoring a stack keeps its whole halves keyed on its parameters and not the
    controller-folded cores beside them; an in-place write to a controller makes them again."""
    from comera_rec.tensor import cached_weights
    from comera_rec.tensor.derived import derived_cache
    from comera_rec.tensor.stacked import StackedTTMTables

    torch.manual_seed(0)
    stack = StackedTTMTables([900, 1000], 8, rank=4, row_shape=(10, 10, 10), col_shape=(2, 2, 2))
    with torch.no_grad():
        for c in stack.controllers:
            c.uniform_(0.5, 1.5)
    ids = torch.randint(0, 900, (30,))
    trains = torch.randint(0, 2, (30,))
    offsets = torch.arange(0, 31, 3)
    want = stack(ids, offsets, trains).detach()  # gradients on: the per-batch lookup
    with torch.no_grad(), cached_weights():
        for _ in range(2):
            torch.testing.assert_close(stack(ids, offsets, trains), want, rtol=1e-5, atol=1e-6)
        halves = derived_cache(stack, "whole_halves").peek(stack.train_tensors())
        assert halves is not None and sum(t.nbytes for t in halves) == kernels.ttm_cpu.whole_halves_bytes(
            list(stack.cores)
        )
        assert derived_cache(stack, "scaled_cores").is_empty()  # the folded cores are not kept
        stack.controllers[0].mul_(2.0)
        assert derived_cache(stack, "whole_halves").peek(stack.train_tensors()) is None
        changed = stack(ids, offsets, trains)
    with torch.no_grad():
        torch.testing.assert_close(changed, stack(ids, offsets, trains), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(changed, want)


def fold_by_hand(cores, middle):
    """The middle controller folded into the left half's last core, written out here."""
    bond = (len(cores) + 1) // 2 - 1
    out = list(cores)
    out[bond] = torch.einsum("tanbr,tr->tanbr", cores[bond], middle)
    return out


@pytest.mark.parametrize("rows, cols, ranks", SHAPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_middle_controller_equals_folding_it_in(rows, cols, ranks, mode, weighted) -> None:
    # the kernel scales the distinct prefixes by the controller between the halves; the
    # reference folds it into the core by hand and takes the PyTorch path
    cores = make_cores(3, rows, cols, ranks)
    r = ranks[(len(rows) + 1) // 2 - 1]
    middle = (torch.rand(3, r, dtype=DT, generator=torch.Generator().manual_seed(4)) * 2 - 0.5).requires_grad_()
    ids, trains, offsets, weights = make_batch(3, math.prod(rows))
    weights = weights if weighted else None
    dim = math.prod(cols) - 1
    inputs = [*cores, middle] + ([weights] if weighted else [])
    got = ttm_embedding_bag(cores, rows, dim, ids, offsets, mode, weights, trains, middle=middle)
    want = lookup(fold_by_hand(cores, middle), rows, dim, ids, offsets, mode, weights, trains, kernel=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_middle_controller_gradcheck() -> None:
    cores = make_cores(2, (2, 3, 2, 2), (2, 1, 2, 1), [3, 5, 2])
    middle = torch.rand(2, 5, dtype=DT, requires_grad=True)
    ids = torch.tensor([0, 23, 23, 4, 17, 2, 9])
    trains = torch.tensor([0, 1, 1, 0, 1, 0, 0])
    offsets = torch.tensor([0, 2, 2, 7])
    weights = torch.rand(7, dtype=DT, requires_grad=True)

    def fn(c0, c1, c2, c3, m, w):
        return ttm_embedding_bag([c0, c1, c2, c3], (2, 3, 2, 2), 4, ids, offsets, "sum", w, trains, middle=m)

    assert torch.autograd.gradcheck(fn, (*cores, middle, weights))


@pytest.mark.parametrize("path", ["kernel", "torch", "torch_static"])
@pytest.mark.parametrize("tables", [1, 3])
def test_gradients_come_laid_out_as_their_parameters(path: str, tables: int) -> None:
    # DDP copies each gradient into a bucket view with its parameter's strides and warns when
    # they differ, size-1 dims included (one stacked table: a (1, r) middle controller); the
    # kernel pads the middle rank to whole vectors, the PyTorch paths reach the cores
    # through permutes
    rows, cols, ranks = (5, 6, 7, 4), (2, 2, 2, 2), [6, 5, 4]
    cores = make_cores(tables, rows, cols, ranks)
    middle = torch.rand(tables, 5, dtype=DT, requires_grad=True)
    ids, trains, offsets, weights = make_batch(tables, math.prod(rows))
    kernels.set_cpu_kernel_enabled(path == "kernel")
    try:
        out = ttm_embedding_bag(
            cores, rows, 16, ids, offsets, "sum", weights, trains, middle=middle, static_shapes=path == "torch_static"
        )
    finally:
        kernels.set_cpu_kernel_enabled(True)
    params = [*cores, middle, weights]
    grads = torch.autograd.grad(out, params, torch.randn_like(out))
    for p, g in zip(params, grads):
        assert p.stride() == torch.empty(p.shape).stride()  # row-major, as made
        assert g.stride() == p.stride(), (tuple(p.shape), g.stride(), p.stride())


@pytest.mark.parametrize("threads", [2, 3])
def test_middle_controller_gradient_is_the_same_at_any_thread_count(threads: int) -> None:
    rows, cols, ranks = (5, 6, 7, 4), (2, 2, 2, 2), [6, 9, 4]
    cores = make_cores(2, rows, cols, ranks)
    middle = torch.rand(2, 9, dtype=DT, requires_grad=True)
    ids, trains, offsets, _ = make_batch(2, math.prod(rows), n_ids=3000)  # > one partial of slots

    def run():
        out = ttm_embedding_bag(cores, rows, 16, ids, offsets, "sum", None, trains, middle=middle)
        return [out, *torch.autograd.grad(out.square().sum(), [*cores, middle])]

    assert_bit_identical(at_thread_counts(run, (1, threads)))


def test_middle_controller_of_the_wrong_shape_is_named() -> None:
    cores = make_cores(2, (4, 5, 6, 3), (2, 3, 2, 2), [3, 7, 5])
    ids, trains, offsets, _ = make_batch(2, 4 * 5 * 6 * 3)
    with pytest.raises(RuntimeError, match=r"middle controller must be \(T, r\) = \(2, 7\)"):
        ttm_embedding_bag(cores, (4, 5, 6, 3), 8, ids, offsets, "sum", None, trains, middle=torch.ones(2, 3, dtype=DT))
    kernels.set_cpu_kernel_enabled(False)
    try:  # the PyTorch path folds it, and says the same
        with pytest.raises(ValueError, match=r"middle controller must be \(T, r\) = \(2, 7\)"):
            ttm_embedding_bag(
                cores, (4, 5, 6, 3), 8, ids, offsets, "sum", None, trains, middle=torch.ones(2, 3, dtype=DT)
            )
    finally:
        kernels.set_cpu_kernel_enabled(True)


def test_stacked_tables_train_with_the_middle_controller_in_the_kernel(monkeypatch) -> None:
    """A stack's training lookup leaves the controller between its halves to the kernel (the
    cores it passes have it unfolded); values and every gradient equal the PyTorch path's,
    which folds all of them."""
    from comera_rec.tensor import stacked as stacked_module
    from comera_rec.tensor.stacked import StackedTTMTables

    torch.manual_seed(0)
    stack = StackedTTMTables([900, 1000], 8, rank=4, row_shape=(10, 10, 10), col_shape=(2, 2, 2)).double()
    with torch.no_grad():
        for c in stack.controllers:
            c.uniform_(0.5, 1.5)
    seen = []
    original = stacked_module.ttm_embedding_bag

    def spy(*args, **kwargs):
        seen.append(kwargs.get("middle"))
        return original(*args, **kwargs)

    monkeypatch.setattr(stacked_module, "ttm_embedding_bag", spy)
    ids = torch.randint(0, 900, (60,))
    trains = torch.randint(0, 2, (60,))
    offsets = torch.arange(0, 61, 3)
    params = [*stack.cores, *stack.controllers]
    got = stack(ids, offsets, trains)
    assert seen[-1] is stack.controllers[1]  # 3 cores: halves of 2 and 1, meeting at bond 1
    grads = torch.autograd.grad(got.square().sum(), params)
    kernels.set_cpu_kernel_enabled(False)
    try:
        want = stack(ids, offsets, trains)
        want_grads = torch.autograd.grad(want.square().sum(), params)
    finally:
        kernels.set_cpu_kernel_enabled(True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows, cols, ranks", [((6, 5, 4, 7), (2, 2, 2, 2), [32, 32, 32]), ((30, 27), (4, 4), [20])])
def test_middle_controller_in_float32_equals_float64_folded(rows, cols, ranks) -> None:
    cores64 = make_cores(2, rows, cols, ranks)
    r = ranks[(len(rows) + 1) // 2 - 1]
    middle64 = torch.rand(2, r, dtype=DT, generator=torch.Generator().manual_seed(5)) + 0.5
    cores32 = [c.detach().float().requires_grad_() for c in cores64]
    middle32 = middle64.float().requires_grad_()
    ids, trains, offsets, _ = make_batch(2, math.prod(rows), n_ids=300)
    got = ttm_embedding_bag(cores32, rows, 16, ids, offsets, "sum", None, trains, middle=middle32)
    want = lookup(fold_by_hand(cores64, middle64), rows, 16, ids, offsets, "sum", None, trains, kernel=False)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    (grad_middle,) = torch.autograd.grad(got.sum(), [middle32])
    (want_middle,) = torch.autograd.grad(
        lookup(
            fold_by_hand(cores64, middle64.requires_grad_()), rows, 16, ids, offsets, "sum", None, trains, False
        ).sum(),
        [middle64],
    )
    torch.testing.assert_close(grad_middle.double(), want_middle, rtol=1e-4, atol=1e-4)


def streams_batch(streams, batch, num_rows, tables, seed=0):
    """A key-major jagged batch of ``streams * batch`` bags (bag ``f * batch + b``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (streams * batch,), generator=g)
    n = int(lengths.sum())
    ids = torch.randint(0, num_rows, (n,), generator=g)
    trains = torch.randint(0, tables, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    weights = torch.rand(n, generator=g, dtype=DT).requires_grad_()
    return ids, trains, offsets, weights


@pytest.mark.parametrize("rows, cols, ranks", SHAPES[1:])
@pytest.mark.parametrize("weighted", [False, True])
def test_bags_written_into_a_shared_output_equal_the_gathered_lookups(rows, cols, ranks, weighted) -> None:
    # two lookups (3 and 2 streams of 5 bags) write into one (5, 7 D) output at scattered
    # columns, after a first writer filled columns 1 and 5 (the output's whole gradient
    # reaches it, and it reads its own columns); values and every gradient against the
    # lookups' own outputs put side by side by torch
    batch, dim = 5, math.prod(cols)
    first_cores, second_cores = make_cores(2, rows, cols, ranks, seed=1), make_cores(3, rows, cols, ranks, seed=2)
    middles = [
        (
            torch.rand(t, ranks[(len(rows) + 1) // 2 - 1], dtype=DT, generator=torch.Generator().manual_seed(t)) + 0.5
        ).requires_grad_()
        for t in (2, 3)
    ]
    batches = [streams_batch(3, batch, math.prod(rows), 2, seed=3), streams_batch(2, batch, math.prod(rows), 3, seed=4)]
    cols_of = [[4 * dim, 0, 2 * dim], [6 * dim, 3 * dim]]  # the columns of each lookup's streams
    base = torch.randn(batch, 2 * dim, dtype=DT, generator=torch.Generator().manual_seed(5)).requires_grad_()
    base_cols = torch.cat([torch.arange(dim, 2 * dim), torch.arange(5 * dim, 6 * dim)])
    upstream = torch.randn(batch, 7 * dim, dtype=DT, generator=torch.Generator().manual_seed(6))
    weights = [b[3] if weighted else None for b in batches]

    def lookups(into: bool):
        out = torch.zeros(batch, 7 * dim, dtype=DT).index_copy(1, base_cols, base * 2)
        parts = []
        for cores, middle, (ids, trains, offsets, _), w, cols in zip(
            (first_cores, second_cores), middles, batches, weights, cols_of
        ):
            args = (cores, rows, dim, ids, offsets, "sum", w, trains)
            if into:
                out = kernels.ttm_embedding_bag_cpu(*args, stream_batch=batch, middle=middle, into=(out, cols))
            else:
                parts.append((kernels.ttm_embedding_bag_cpu(*args, stream_batch=batch, middle=middle), cols))
        if into:
            return out
        full = out.clone()
        for bags, cols in parts:
            for f, c in enumerate(cols):
                full[:, c : c + dim] = bags[:, f * dim : (f + 1) * dim]
        return full

    inputs = [base, *first_cores, *second_cores, *middles] + ([w for w in weights] if weighted else [])
    got, want = lookups(into=True), lookups(into=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(got, inputs, upstream), torch.autograd.grad(want, inputs, upstream)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_bags_written_into_an_output_without_gradients() -> None:
    rows, cols, ranks = SHAPES[2]
    dim, batch = math.prod(cols), 4
    cores = [c.detach() for c in make_cores(2, rows, cols, ranks)]
    ids, trains, offsets, _ = streams_batch(2, batch, math.prod(rows), 2)
    out = torch.full((batch, 3 * dim), 7.0, dtype=DT)
    args = (cores, rows, dim, ids, offsets, "sum", None, trains)
    got = kernels.ttm_embedding_bag_cpu(
        *args, stream_batch=batch, middle=torch.ones(2, ranks[1], dtype=DT), into=(out, [2 * dim, 0])
    )
    want = kernels.ttm_embedding_bag_cpu(*args, stream_batch=batch)
    assert got is out
    torch.testing.assert_close(out[:, 2 * dim :], want[:, :dim], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, :dim], want[:, dim:], rtol=1e-12, atol=1e-12)
    assert torch.all(out[:, dim : 2 * dim] == 7.0)  # a column no stream names keeps its values


def test_a_bad_output_layout_is_named() -> None:
    rows, cols, ranks = SHAPES[2]
    dim, batch = math.prod(cols), 4
    cores = [c.detach() for c in make_cores(2, rows, cols, ranks)]
    ids, trains, offsets, _ = streams_batch(2, batch, math.prod(rows), 2)
    args = (cores, rows, dim, ids, offsets, "sum", None, trains)
    out = torch.zeros(batch, 2 * dim, dtype=DT)
    with pytest.raises(RuntimeError, match="columns"):  # the second stream would overrun a row
        kernels.ttm_embedding_bag_cpu(
            *args, stream_batch=batch, middle=torch.ones(2, ranks[1], dtype=DT), into=(out, [0, dim + 1])
        )
    with pytest.raises(RuntimeError, match="column offsets for 2 streams"):
        kernels.ttm_embedding_bag_cpu(
            *args, stream_batch=batch, middle=torch.ones(2, ranks[1], dtype=DT), into=(out, [0])
        )
    with pytest.raises(ValueError, match="stream_batch > 0"):
        kernels.ttm_embedding_bag_cpu(*args, into=(out, [0, dim]))
