"""Factorising dimensions into tensor-train mode sizes.

A tensor train needs every dimension written as a product of small factors
(``1024 -> 8 x 8 x 16``). Dimensions that factor badly (primes such as 367, or
10131227) are padded up to the cheapest product that holds them; the padded rows or
columns are never read.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

# The largest padding we accept before trying the next larger product range.
_DEFAULT_MAX_PADDING = 0.10

CostFn = Callable[[Sequence[int]], float]


def _balanced_cost(factors: Sequence[int]) -> float:
    # For a fixed product the sum is smallest when the factors are equal; with a
    # uniform rank r the parameter count is roughly r^2 * sum(factors).
    return float(sum(factors))


def _balanced_key(factors: tuple[int, ...], n: int) -> tuple[float, tuple[int, ...]]:
    """Least is best: the factor sum, scaled by ``(product / n)^8`` against padding; ties by the tuple."""
    return _balanced_cost(factors) * (math.prod(factors) / n) ** 8, factors


def _best_multiset(
    n: int,
    k: int,
    low: int,
    limit: float,
    cap: int,
    prefix: tuple[int, ...] = (),
    prod: int = 1,
) -> tuple[float, tuple[int, ...]] | None:
    """The best (see :func:`_balanced_key`) non-decreasing tuple of k factors in [low, cap]
    with ``n <= product <= limit`` (the last factor is the least that reaches n), or None.

    Keeps only the best so far: a 4-factor search for a 10M-row table visits ~350k
    tuples, which as a list held ~26 MB until the garbage collector ran.
    """
    left = k - len(prefix)
    if left == 1:
        last = max(low, -(-n // prod))  # ceil division
        if prod * last <= limit and last <= cap:
            return _balanced_key(prefix + (last,), n)
        return None
    best = None
    # The smallest remaining factor is at most the left-th root of what remains.
    hi = min(cap, int(math.floor((limit / prod) ** (1.0 / left) + 1e-9)))
    for f in range(low, hi + 1):
        found = _best_multiset(n, k, f, limit, cap, prefix + (f,), prod * f)
        if found is not None and (best is None or found < best):
            best = found
    return best


def factorize(
    n: int,
    num_factors: int,
    *,
    cost: CostFn | None = None,
    max_padding: float = _DEFAULT_MAX_PADDING,
) -> tuple[int, ...]:
    """Write ``n`` as ``num_factors`` factors whose product is at least ``n``.

    The factors are chosen balanced: the least sum of factors, each sum scaled by
    ``(product / n)^8`` so that padding is taken only when ``n`` factors badly (a prime
    such as 367). The bound on padding doubles until a factorisation exists. The order
    of the factors is then the one of least ``cost`` (for example the contraction cost
    of a layer at its rank, which puts small factors where the rank is large).

    Args:
        n: the dimension to factorise (>= 1).
        num_factors: how many factors (>= 1).
        cost: maps an ordered factor tuple to a cost; ``None`` keeps ascending order.
        max_padding: the first bound on the relative padding ``product / n - 1``.

    Returns:
        The factors, ordered as ``cost`` prefers.

    Example::

        >>> factorize(1024, 3)
        (8, 8, 16)
        >>> factorize(367, 3)
        (6, 7, 9)
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"factorize: n must be a positive integer, got {n!r}")
    if not isinstance(num_factors, int) or num_factors < 1:
        raise ValueError(f"factorize: num_factors must be a positive integer, got {num_factors!r}")
    if num_factors == 1:
        return (n,)
    low = 2 if n >= 2**num_factors else 1
    # Factors far from the k-th root are never the balanced choice: skip them.
    cap = max(low, 4 * math.ceil(n ** (1.0 / num_factors)) + 2)
    padding = max_padding
    while True:
        limit = max(n * (1.0 + padding), low**num_factors)
        found = _best_multiset(n, num_factors, low, limit, cap)
        if found is not None:
            break
        padding *= 2.0
    best = found[1]
    if cost is None:
        return best
    return min(sorted(set(itertools.permutations(best))), key=cost)


def check_shape(name: str, dim: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Validate an explicit factor shape for a dimension and return it as a tuple.

    Raises:
        ValueError: if a factor is not a positive integer or the product is < dim.
    """
    shape = tuple(shape)
    if len(shape) == 0 or any((not isinstance(f, int)) or f < 1 for f in shape):
        raise ValueError(f"{name}: shape factors must be positive integers, got {list(shape)}")
    if math.prod(shape) < dim:
        raise ValueError(
            f"{name}: shape {list(shape)} has product {math.prod(shape)}, which cannot hold dimension {dim}"
        )
    return shape


def default_num_cores(dim: int) -> int:
    """How many cores a side of ``dim`` gets by default: 2 up to 256, 3 up to 2^20, else 4.

    Example::

        >>> default_num_cores(768), default_num_cores(10131227)
        (3, 4)
    """
    if dim <= 256:
        return 2
    if dim <= 1 << 20:
        return 3
    return 4


def ttm_row_shape(num_embeddings: int, embedding_shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """Row factors of a TTM table, chosen by the parameter count at ``rank``.

    The middle cores pay ``rank^2`` per entry, the end cores ``rank``, so the smallest
    row factors go to the middle.

    Example::

        >>> ttm_row_shape(10131227, (2, 2, 2, 2), 32)
        (59, 53, 54, 60)
    """
    m = tuple(embedding_shape)
    d = len(m)

    def params(order: Sequence[int]) -> float:
        ranks = [1] + [rank] * (d - 1) + [1]
        return float(sum(ranks[k] * order[k] * m[k] * ranks[k + 1] for k in range(d)))

    return factorize(num_embeddings, d, cost=params)


def tt_linear_shapes(
    in_features: int, out_features: int, num_cores: int | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Input-side and output-side factors of a TT linear layer (same count on each side).

    Example::

        >>> tt_linear_shapes(768, 3072)
        ((8, 8, 12), (12, 16, 16))
    """
    d = num_cores or max(default_num_cores(in_features), default_num_cores(out_features))
    if not 1 <= d <= 4:
        raise ValueError(f"tt_linear_shapes: num_cores per side must be in [1, 4], got {d}")
    return factorize(in_features, d), factorize(out_features, d)
