"""CompressionPolicy's table plans: which tables are compressed, and with how many cores."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from comera_rec.integration.policy import CompressionPolicy, plan_table, ttm_num_parameters
from comera_rec.tensor.embedding import ttm_shape
from comera_rec.tensor.train import cap_ranks
from dlrm.config import DLRMConfig


def parameters(shape, rank: int) -> int:
    modes = [n * m for n, m in zip(*shape)]
    return ttm_num_parameters(shape, cap_ranks([rank] * (len(modes) - 1), modes))


def test_mid_size_kaggle_tables_get_two_cores_at_rank_32() -> None:
    policy = CompressionPolicy(rank=32)
    # 3 cores by default; 2 cores take no more parameters (the rank^2 middle core dominates)
    assert ttm_shape(286181, 16, 32) == ((69, 61, 68), (2, 2, 4))
    assert plan_table("t", 286181, 16, policy).shape == ((529, 541), (4, 4))
    assert plan_table("t", 14992, 16, policy).shape == ((119, 126), (4, 4))
    # the large tables keep 4 cores: 2 would take 2.5x (2.2M rows) to 3.6x (10M) the parameters
    assert plan_table("t", 10131227, 16, policy).shape == ((59, 53, 54, 60), (2, 2, 2, 2))
    assert plan_table("t", 2202608, 16, policy).shape == ((41, 33, 37, 44), (2, 2, 2, 2))


def test_two_cores_within_zero_keeps_the_default_shape() -> None:
    policy = CompressionPolicy(rank=32, two_cores_within=0.0)
    assert plan_table("t", 286181, 16, policy).shape == ttm_shape(286181, 16, 32)


def test_dlrm_config_passes_the_setting_on() -> None:
    assert DLRMConfig.kaggle(two_cores_within=0.0).policy().two_cores_within == 0.0
    assert DLRMConfig.kaggle().policy().two_cores_within == 2.0


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(10_000, 20_000_000),
    dim=st.sampled_from([8, 16, 32, 64, 128]),
    rank=st.sampled_from([4, 8, 16, 32, 64]),
    within=st.sampled_from([1.0, 1.5, 2.0, 4.0]),
)
def test_two_cores_exactly_when_within_the_factor(rows: int, dim: int, rank: int, within: float) -> None:
    policy = CompressionPolicy(rank=rank, min_gain=0.0, two_cores_within=within)
    plan = plan_table("t", rows, dim, policy)
    default = ttm_shape(rows, dim, rank)
    two = ttm_shape(rows, dim, rank, num_cores=2)
    assert math.prod(plan.shape[0]) >= rows and math.prod(plan.shape[1]) >= dim
    if len(default[0]) == 2:
        assert plan.shape == default
    elif parameters(two, rank) <= within * parameters(default, rank):
        assert plan.shape == two
    else:
        assert plan.shape == default
