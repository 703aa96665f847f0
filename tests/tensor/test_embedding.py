import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comera_rec import TTMEmbeddingBag
from comera_rec.tensor.bags import pool_bags
from comera_rec.tensor.contract import ttm_embedding_bag, ttm_rows

from .reference import embedding_bag, full_train, ttm_table

DT = torch.float64


def make_bag(mode="sum", rank=3, shape=((3, 4, 5), (2, 2, 3)), num=55, dim=11) -> TTMEmbeddingBag:
    bag = TTMEmbeddingBag(num, dim, rank=rank, mode=mode, shape=shape, dtype=DT)
    with torch.no_grad():
        for c in bag.cores:
            c.normal_()
        for d in bag.controllers:
            d.uniform_(0.5, 1.5)
    return bag


def batch(num=55, n_ids=30, n_bags=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    # repeated ids so that row-level de-duplication matters
    ids = torch.randint(0, num, (n_ids // 2,), generator=g).repeat(2)[torch.randperm(n_ids, generator=g)]
    cuts = torch.sort(torch.randint(0, n_ids + 1, (n_bags - 1,), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n_ids])])
    weights = torch.rand(n_ids, generator=g, dtype=DT)
    return ids, offsets, weights


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_backward_match_dense_table(mode: str, weighted: bool, lookup_path: str) -> None:
    bag = make_bag(mode)
    ids, offsets, weights = batch()
    weights = weights if weighted else None
    table = ttm_table(bag)
    torch.testing.assert_close(bag.dense_weight(), table)
    out = bag(ids, offsets, weights)
    ref = embedding_bag(table, ids, offsets, mode, weights)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    params = [*bag.cores, *bag.controllers]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b)


def test_per_sample_weight_gradient(lookup_path: str) -> None:
    bag = make_bag("sum")
    ids, offsets, weights = batch()
    weights.requires_grad_(True)
    out = bag(ids, offsets, weights)
    ref = embedding_bag(ttm_table(bag).detach(), ids, offsets, "sum", weights)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, weights, g)[0], torch.autograd.grad(ref, weights, g)[0])


def test_gradcheck_lookup(lookup_path: str) -> None:
    shape = ((2, 3), (2, 2))
    cores = [
        torch.randn(1, 1, 2, 2, 3, dtype=DT, requires_grad=True),
        torch.randn(1, 3, 3, 2, 1, dtype=DT, requires_grad=True),
    ]
    ids = torch.tensor([0, 5, 5, 3, 1])
    offsets = torch.tensor([0, 2, 2, 5])
    weights = torch.rand(5, dtype=DT, requires_grad=True)

    def fn(c0, c1, w):
        return ttm_embedding_bag([c0, c1], shape[0], 3, ids, offsets, "sum", w)

    assert torch.autograd.gradcheck(fn, (*cores, weights))


def test_stacked_tables_in_one_call() -> None:
    # Two tables of the same TT shape looked up together equal two separate lookups.
    bags = [make_bag(), make_bag()]
    stacked = [torch.stack([a, b]) for a, b in zip(bags[0].scaled_cores(), bags[1].scaled_cores())]
    ids, offsets, _ = batch()
    trains = torch.arange(ids.numel()) % 2
    rows = ttm_rows(stacked, bags[0].row_shape, ids, trains)
    tables = [ttm_table(b) for b in bags]
    want = torch.stack([tables[int(t)][int(i)] for t, i in zip(trains, ids)])
    torch.testing.assert_close(rows[:, :11], want)


def test_prefix_and_suffix_are_computed_once(monkeypatch) -> None:
    from comera_rec.tensor import halves, kernels

    monkeypatch.setattr(kernels, "cpu_kernel_applies", lambda *args: False)  # the PyTorch path's internals

    bag = make_bag(shape=((16, 16, 4, 4), (1, 2, 2, 3)), num=4096, dim=12)
    produced = []
    for name in ("left_table", "right_table", "right_rows"):
        original = getattr(halves, name)

        def recording(cores, *keys, _original=original, _name=name):
            out = _original(cores, *keys)
            produced.append((_name, out.shape[0]))
            return out

        monkeypatch.setattr(halves, name, recording)
    # 48 ids, 16 distinct rows, all with the prefix (0, 0), 16 distinct suffixes
    ids = torch.arange(16).repeat(3)
    bag(ids, torch.tensor([0, 48]))
    # the one prefix is contracted once from its gathered slices (the left half has 256
    # indices); the 16 suffixes are read from the whole right half (4 x 4 indices),
    # contracted by one GEMM; never one contraction per id
    assert produced == [("left_table", 1), ("right_rows", 16)]


def test_right_rows_equal_the_right_table_rows() -> None:
    """The one-GEMM right half read by key equals the batched table, values and gradients."""
    from comera_rec.tensor.halves import right_rows as _right_rows
    from comera_rec.tensor.halves import right_table as _right_table

    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, 5, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)  # (T, r, n_a, m_a, r_a)
    b = torch.randn(3, 3, 6, 3, 1, generator=g, dtype=torch.float64, requires_grad=True)  # (T, r_a, n_b, m_b, 1)
    keys = torch.tensor([0, 89, 17, 17, 45, 60])  # (t * 5 + i_a) * 6 + i_b, repeats included
    expected = _right_table([a, b]).index_select(0, keys)  # (K, m_b, r, m_a)
    out = _right_rows([a, b], keys)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for x, y in zip(torch.autograd.grad(out, [a, b], grad), torch.autograd.grad(expected, [a, b], grad)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_half_tables_agree_between_gather_and_full_paths() -> None:
    from comera_rec.tensor.halves import half as _half

    bag = make_bag(shape=((4, 4, 4, 4), (1, 2, 2, 3)), num=256, dim=12)
    cores = [c.unsqueeze(0) for c in bag.scaled_cores()]
    keys = torch.tensor([0, 5, 5, 15, 3])
    for left, part in ((True, cores[:2]), (False, cores[2:])):
        gathered = _half(part, (4, 4), keys, left, strategy="gather")
        full = _half(part, (4, 4), keys, left, strategy="full")
        assert gathered.shape == (5, 2, 3) if left else (5, 3, 6)
        torch.testing.assert_close(gathered, full)
        torch.testing.assert_close(gathered[1], gathered[2])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # lookup_path: set per run, not per example
@given(
    d=st.integers(2, 4),
    rank=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["sum", "mean"]),
)
def test_property_shapes_and_ranks(d, rank, seed, mode, lookup_path) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = [int(v) for v in torch.randint(1, 4, (d,), generator=g)]
    cols = [int(v) for v in torch.randint(1, 3, (d,), generator=g)]
    num = max(1, int(torch.tensor(rows).prod()) - int(torch.randint(0, 2, (), generator=g)))
    dim = int(torch.tensor(cols).prod())
    bag = TTMEmbeddingBag(num, dim, rank, mode=mode, shape=(rows, cols), dtype=DT)
    assert all(r <= rank for r in bag.ranks)
    ids = torch.randint(0, num, (7,), generator=g)
    offsets = torch.tensor([0, 3, 3, 7])
    torch.testing.assert_close(bag(ids, offsets), embedding_bag(ttm_table(bag), ids, offsets, mode))


def test_truncation_keeps_output_and_shrinks(lookup_path: str) -> None:
    bag = make_bag(rank=4, shape=((3, 4, 5), (2, 2, 3)))
    with torch.no_grad():
        bag.controllers[0][1] = 0.0
        bag.controllers[1][[0, 3]] = 1e-9
    ids, offsets, _ = batch()
    before, size_before = bag(ids, offsets), bag.tt_size()
    assert bag.truncate_ranks(1e-2)
    assert bag.ranks == [3, 2]
    assert [tuple(c.shape) for c in bag.cores] == [(1, 3, 2, 3), (3, 4, 2, 2), (2, 5, 3, 1)]
    assert bag.tt_size() < size_before
    torch.testing.assert_close(bag(ids, offsets), before)


def test_all_dead_bond_keeps_the_largest_slice() -> None:
    bag = make_bag(rank=3)
    with torch.no_grad():
        bag.controllers[0].copy_(torch.tensor([1e-5, 3e-3, 1e-4], dtype=DT))
    bag.truncate_ranks(1e-2)
    assert bag.ranks[0] == 1
    assert float(bag.controllers[0].detach()[0]) == pytest.approx(3e-3)


def test_size_counts_column_factors() -> None:
    bag = TTMEmbeddingBag(60, 12, rank=2, shape=((3, 4, 5), (2, 2, 3)))
    # S = 1*3*2*2 + 2*4*2*2 + 2*5*3*1
    assert bag.tt_size() == 12 + 32 + 30
    assert bag.num_parameters() == 74 + 4
    assert bag.compression_ratio() == pytest.approx(720 / 78)


def test_from_embedding_exact_at_full_rank(lookup_path: str) -> None:
    table = torch.randn(50, 6, dtype=DT)
    bag = TTMEmbeddingBag.from_embedding(table, rank=1000, shape=((3, 4, 5), (1, 2, 3)))
    torch.testing.assert_close(bag.dense_weight(), table)
    ids, offsets, w = batch(num=50)
    torch.testing.assert_close(bag(ids, offsets, w), embedding_bag(table, ids, offsets, "sum", w))


def test_full_train_reference_agrees_with_dense_weight() -> None:
    bag = make_bag()
    assert full_train(list(bag.cores), list(bag.controllers)).shape == (3, 2, 4, 2, 5, 3)


def test_empty_bags_and_empty_input(lookup_path: str) -> None:
    bag = make_bag()
    out = bag(torch.tensor([], dtype=torch.long), torch.tensor([0, 0, 0]))
    assert out.shape == (2, 11) and bool((out == 0).all())


def test_pool_bags_mean_with_weights_divides_by_length() -> None:
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = pool_bags(rows, torch.tensor([0, 1, 1]), torch.tensor([0, 2, 3]), "mean", torch.tensor([1.0, 2.0, 0.5]))
    torch.testing.assert_close(out, torch.tensor([[3.5, 5.0], [1.5, 2.0]]))


def test_bad_input_names_the_value() -> None:
    bag = TTMEmbeddingBag(100, 8, rank=2)
    ok = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="id -1 is negative"):
        bag(torch.tensor([-1, 2]), ok)
    with pytest.raises(ValueError, match="id 100 is out of range for num_embeddings=100"):
        bag(torch.tensor([5, 100]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"non-decreasing.*offsets\[2\]=1"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="must end at len\\(ids\\)=3, got 2"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="start at 0, got 1"):
        bag(torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="per_sample_weights has shape \\(3,\\), expected \\(2,\\)"):
        bag(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.ones(3))
    with pytest.raises(TypeError, match="integer"):
        bag(torch.tensor([1.0, 2.0]), torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="floating point"):
        TTMEmbeddingBag(100, 8, rank=2, dtype=torch.int32)
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        TTMEmbeddingBag(100, 8, rank=0)
    with pytest.raises(ValueError, match=r"product 64.*cannot hold dimension 100"):
        TTMEmbeddingBag(100, 8, rank=2, shape=((4, 4, 4), (2, 2, 2)))
    with pytest.raises(ValueError, match="mode must be one of"):
        TTMEmbeddingBag(100, 8, rank=2, mode="max")


@pytest.mark.parametrize(
    "ids, offsets, valid",
    [
        ([0, 4, 2], [0, 2, 3], True),
        ([], [0, 0, 0], True),
        ([0, 5, 2], [0, 2, 3], False),  # an id = num_embeddings
        ([-1, 4, 2], [0, 2, 3], False),  # a negative id
        ([0, 4, 2], [1, 2, 3], False),  # offsets not starting at 0
        ([0, 4, 2], [0, 2, 2], False),  # offsets not ending at len(ids)
        ([0, 4, 2], [0, 2, 1, 3], False),  # offsets decreasing
        ([0], [], False),
    ],
)
def test_one_read_summary_agrees_with_check_bags(ids, offsets, valid: bool) -> None:
    """The one-copy summary a GPU batch is checked with says what the full checks say."""
    from comera_rec.tensor.validation import bags_look_valid, check_bags

    ids_t, offsets_t = torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)
    assert bags_look_valid(ids_t, offsets_t, 5) is valid
    if valid:
        check_bags("t", ids_t, offsets_t, 5)
    else:
        with pytest.raises(ValueError):
            check_bags("t", ids_t, offsets_t, 5)
