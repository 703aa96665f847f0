"""CompressionPolicy's table plans: which tables are compressed, and with how many cores."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_rec.dlrm.config import DLRMConfig
from comera_rec.integration.policy import CompressionPolicy, TableOverride, plan_table, plan_tables, ttm_num_parameters
from comera_rec.tensor.embedding import ttm_shape
from comera_rec.tensor.train import cap_ranks


def parameters(shape, rank: int) -> int:
    modes = [n * m for n, m in zip(*shape)]
    return ttm_num_parameters(shape, cap_ranks([rank] * (len(modes) - 1), modes))


def test_mid_size_kaggle_tables_get_two_cores_at_rank_32() -> None:
    policy = CompressionPolicy(rank=32, min_params_to_compress=0)
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
    policy = CompressionPolicy(rank=rank, min_gain=0.0, min_params_to_compress=0, two_cores_within=within)
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


def test_tables_under_a_million_parameters_stay_dense() -> None:
    policy = CompressionPolicy(rank=32)
    assert not plan_table("t", 14992, 16, policy).compressed  # 240k parameters
    assert plan_table("t", 93145, 16, policy).compressed  # 1.49M
    assert plan_table("t", 11938, 128, policy).compressed  # 1.53M: the dim counts, not only the rows
    assert not plan_table("t", 7424, 128, policy).compressed  # under min_rows_to_compress
    assert plan_table("t", 14992, 16, CompressionPolicy(rank=32, min_params_to_compress=0)).compressed
    assert DLRMConfig.kaggle(min_params_to_compress=0).policy().min_params_to_compress == 0


def test_kaggle_tables_take_two_lookups() -> None:
    cfg = DLRMConfig.kaggle()
    plans = plan_tables([(f"t{i}", n, 16) for i, n in enumerate(cfg.table_sizes)], cfg.policy())
    groups: dict = {}
    for (name, plan), rows in zip(plans.items(), cfg.table_sizes):
        if plan.compressed:
            groups.setdefault(plan.shape, []).append(rows)
    # the 2.2M-row table takes the 10M-row table's shape (227k parameters, 1.52x its own);
    # the 286k-row table keeps its 2 cores (the 4-core shape would cost only 1.66x) and
    # leads the 2-core tables
    assert groups == {
        ((59, 53, 54, 60), (2, 2, 2, 2)): [10131227, 2202608, 8351593, 5461306, 7046547],
        ((529, 541), (4, 4)): [93145, 286181, 142572],
    }


def test_share_shapes_within_zero_gives_every_table_its_own_shape() -> None:
    tables = [("a", 10131227, 16), ("b", 8351593, 16), ("c", 286181, 16)]
    plans = plan_tables(tables, CompressionPolicy(rank=32, share_shapes_within=0.0))
    assert plans == {name: plan_table(name, rows, dim, CompressionPolicy(rank=32)) for name, rows, dim in tables}


def test_tables_of_other_ranks_or_dims_do_not_share() -> None:
    tables = [("a", 4_000_000, 16), ("b", 3_000_000, 16), ("c", 3_500_000, 32)]
    plans = plan_tables(tables, CompressionPolicy(rank=8, per_table={"b": 16}))
    assert plans["b"].shape == plan_table("b", 3_000_000, 16, CompressionPolicy(rank=16)).shape
    assert plans["c"].shape == plan_table("c", 3_500_000, 32, CompressionPolicy(rank=8)).shape
    fixed = plan_tables(tables, CompressionPolicy(rank=8, per_table={"b": TableOverride(shape=((2000, 1500), (4, 4)))}))
    assert fixed["b"].shape == ((2000, 1500), (4, 4))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(70_000, 30_000_000), min_size=1, max_size=8),
    rank=st.sampled_from([4, 8, 16, 32]),
    within=st.sampled_from([1.0, 1.5, 2.0, 3.0]),
)
def test_a_shared_shape_holds_the_rows_and_costs_at_most_the_factor(sizes: list[int], rank: int, within: float) -> None:
    policy = CompressionPolicy(rank=rank, min_gain=0.0, share_shapes_within=within)
    tables = [(f"t{i}", n, 16) for i, n in enumerate(sizes)]
    plans = plan_tables(tables, policy)
    for name, rows, dim in tables:
        own = plan_table(name, rows, dim, policy)
        plan = plans[name]
        assert math.prod(plan.shape[0]) >= rows and math.prod(plan.shape[1]) >= dim
        if plan.shape != own.shape:  # it took a larger table's shape, with as many cores
            assert len(plan.shape[0]) == len(own.shape[0])
            assert ttm_num_parameters(plan.shape, plan.ranks) <= within * ttm_num_parameters(own.shape, own.ranks)
            assert any(plan.shape == plans[other].shape and n > rows for other, n, _ in tables)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("rank", 0, "rank: expected an integer >= 1, got 0"),
        ("rank", 8.0, "rank: expected an integer >= 1, got 8.0"),
        ("linear_rank", -1, "linear_rank: expected an integer >= 1"),
        ("min_rows_to_compress", -5, "min_rows_to_compress: expected an integer >= 0"),
        ("min_params_to_compress", True, "min_params_to_compress: expected an integer >= 0"),
        ("min_gain", -1.0, "min_gain: expected a finite number >= 0"),
        ("linear_min_gain", math.nan, "linear_min_gain: expected a finite number >= 0"),
        ("two_cores_within", math.inf, "two_cores_within: expected a finite number >= 0"),
        ("share_shapes_within", "2", "share_shapes_within: expected a finite number >= 0"),
        ("per_table", {"t_a": 0}, r"per_table\['t_a'\]: rank must be an integer >= 1, got 0"),
        ("per_table", {"t_a": TableOverride(rank=-3)}, r"per_table\['t_a'\]: rank must be"),
        ("per_table", {"t_a": "zip"}, r"per_table\['t_a'\]: expected a TableOverride"),
        ("per_table", ["t_a"], "per_table: expected a mapping"),
    ],
)
def test_bad_fields_are_named(field: str, value, expected: str) -> None:
    with pytest.raises(ValueError, match=f"CompressionPolicy.{expected}"):
        CompressionPolicy(**{field: value})


def test_edge_values_are_accepted() -> None:
    policy = CompressionPolicy(
        rank=1,
        linear_rank=None,
        min_rows_to_compress=0,
        min_params_to_compress=0,
        min_gain=0.0,
        two_cores_within=0,
        share_shapes_within=0.0,
        per_table={"a": "dense", "b": "compress", "c": 4, "d": TableOverride(rank=2)},
    )
    assert policy.table_rank("c") == 4 and policy.table_rank("d") == 2 and policy.mlp_rank == 1
