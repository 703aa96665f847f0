import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from comera_rec.tensor.shapes import check_shape, factorize, tt_linear_shapes, ttm_row_shape


@pytest.mark.parametrize(
    "n, k, expected",
    [(1024, 3, (8, 8, 16)), (768, 3, (8, 8, 12)), (3072, 3, (12, 16, 16)), (367, 3, (6, 7, 9))],
)
def test_factorize_reference_values(n: int, k: int, expected: tuple[int, ...]) -> None:
    assert factorize(n, k) == expected


@pytest.mark.parametrize("n", [367, 30522, 10131227, 40_000_000])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_awkward_sizes_are_padded_a_little(n: int, k: int) -> None:
    factors = factorize(n, k)
    assert len(factors) == k
    assert math.prod(factors) >= n
    assert math.prod(factors) <= 1.1 * n  # the first padding bound held
    assert max(factors) <= 2 * min(factors) + 2  # balanced


@given(st.integers(1, 200_000), st.integers(1, 4))
def test_factorize_holds_n(n: int, k: int) -> None:
    factors = factorize(n, k)
    assert len(factors) == k and math.prod(factors) >= n and min(factors) >= 1


def test_factorize_keeps_only_the_best_candidate() -> None:
    """The 4-factor search for a 10M-row table visits ~350k tuples; holding them as a list
    (alive until the garbage collector broke a closure cycle) cost ~26 MB of peak RSS."""
    import tracemalloc

    tracemalloc.start()
    try:
        assert factorize(10131227, 4) == (53, 54, 59, 60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"factorize traced a peak of {peak / 2**20:.1f} MiB"


def test_factorize_equals_an_exhaustive_search() -> None:
    """Against every non-decreasing k-tuple with product in [n, 1.1 n], scored the same way."""
    import itertools

    for n, k in [(367, 3), (1460, 2), (93145, 3), (12517, 3)]:
        limit = 1.1 * n
        pool = range(1, int(limit) + 1) if k == 2 else range(1, int(limit**0.5) + 2)
        best = min(
            (sum(f) * (math.prod(f) / n) ** 8, f)
            for f in itertools.combinations_with_replacement(pool, k)
            if n <= math.prod(f) <= limit and min(f) >= 2
        )[1]
        assert factorize(n, k) == best


def test_cost_picks_the_order() -> None:
    # Middle cores pay rank^2: the smallest factor goes to the middle.
    shape = ttm_row_shape(10131227, (2, 2, 2, 2), rank=32)
    assert sorted(shape) == sorted(factorize(10131227, 4))
    assert min(shape) in shape[1:3]


def test_tt_linear_shapes_same_count_per_side() -> None:
    ins, outs = tt_linear_shapes(13, 512)
    assert len(ins) == len(outs) and math.prod(ins) >= 13 and math.prod(outs) >= 512
    with pytest.raises(ValueError, match="num_cores"):
        tt_linear_shapes(64, 64, num_cores=5)


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="-3"):
        factorize(-3, 2)
    with pytest.raises(ValueError, match="num_factors"):
        factorize(10, 0)
    with pytest.raises(ValueError, match=r"product 12.*cannot hold dimension 13"):
        check_shape("layer", 13, (3, 4))
    with pytest.raises(ValueError, match="positive integers"):
        check_shape("layer", 13, (4, 0))
