"""Which tables and layers are compressed, at what rank and shape.

A :class:`CompressionPolicy` is plain data; :func:`plan_table` and
:func:`linear_pays` turn it into per-module decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

from comera_rec.tensor.embedding import ttm_shape
from comera_rec.tensor.shapes import check_shape, tt_linear_shapes
from comera_rec.tensor.train import cap_ranks, check_rank

Shape = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class TableOverride:
    """Per-table exception to a :class:`CompressionPolicy`."""

    rank: int | None = None
    """TT rank of this table (the policy's ``rank`` when ``None``)."""
    shape: Shape | None = None
    """``(row_factors, column_factors)`` of this table (chosen automatically when ``None``)."""
    dense: bool | None = None
    """``True``: keep dense whatever its size; ``False``: compress even if small; ``None``: the policy decides."""


TableRule = Union[TableOverride, str, int]


@dataclass(frozen=True)
class CompressionPolicy:
    """What to compress in a recommendation model.

    Example::

        >>> policy = CompressionPolicy(rank=16, per_table={"t_small": "dense", "t_big": 32})
        >>> policy.override("t_big").rank
        32
    """

    rank: int = 32
    """TT rank of compressed embedding tables."""
    min_rows_to_compress: int = 10_000
    """Tables with fewer rows stay dense (FBGEMM kernels, sharded by TorchRec)."""
    min_params_to_compress: int = 1_000_000
    """Tables with fewer dense parameters (rows x dim) stay dense too: a TTM lookup call
    costs about as much for a small table as for a large one, and below a million
    parameters (4 MB in float32) it saves little memory (docs/performance-history.md)."""
    min_gain: float = 2.0
    """A table or layer is compressed only if dense parameters / TT parameters >= this."""
    two_cores_within: float = 2.0
    """A table whose default shape has 3 or 4 cores gets 2 cores instead when these take at
    most this many times its parameters: a 2-core lookup multiplies each id's two core
    slices, where 3 or 4 cores add a product per distinct prefix or suffix forward and two
    backward (docs/performance-history.md). 0 keeps the default number of cores."""
    per_table: Mapping[str, TableRule] = field(default_factory=dict)
    """Overrides by table name: a :class:`TableOverride`, ``"dense"``, ``"compress"`` or an int rank."""
    linear_rank: int | None = None
    """TT rank of MLP and cross-net layers (``rank`` when ``None``)."""
    linear_min_gain: float | None = None
    """Dense / TT parameters an MLP or cross-net layer needs to be compressed (``min_gain``
    when ``None``). A layer must also need no more multiply-adds than the dense one, so a
    lower value than the tables' lets through layers that are both smaller and cheaper, but
    by less than ``min_gain`` (DLRM's 256 -> 64 bottom layer at rank 32: 1.54x)."""
    compress_mlps: bool = True
    """Replace MLP linear layers by ``TTLinear`` where it pays."""
    compress_crossnet: bool = True
    """Replace DCN low-rank projections by ``TTLinear`` where it pays."""
    share_shapes_within: float = 2.0
    """A compressed table takes the TT shape (and ranks) of a larger one of the same dim,
    rank and number of cores, automatic shapes both, when that costs at most this many
    times its own TT parameters: the tables are then stacked and looked up in one call,
    and each call saved is worth more than the few parameters (docs/performance-history.md). A
    table never changes its number of cores by it (that would change its lookup's work
    per id). 0 gives every table its own shape."""

    def __post_init__(self) -> None:
        """Reject values no plan can use, naming the field (a typo in a config file or on the
        command line fails here, not deep inside a model build)."""

        def whole(name: str, low: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"CompressionPolicy.{name}: expected an integer >= {low}, got {value!r}")

        def factor(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"CompressionPolicy.{name}: expected a finite number >= 0, got {value!r}")

        whole("rank", 1)
        whole("linear_rank", 1, optional=True)
        whole("min_rows_to_compress", 0)
        whole("min_params_to_compress", 0)
        for name in ("min_gain", "two_cores_within", "share_shapes_within"):
            factor(name)
        if self.linear_min_gain is not None:
            factor("linear_min_gain")
        if not isinstance(self.per_table, Mapping):
            raise ValueError(
                f"CompressionPolicy.per_table: expected a mapping of table name to rule, "
                f"got {type(self.per_table).__name__}"
            )
        for table in self.per_table:
            rank = self.override(table).rank  # raises, naming the table, for a rule it cannot read
            if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
                raise ValueError(f"CompressionPolicy.per_table[{table!r}]: rank must be an integer >= 1, got {rank!r}")

    def override(self, table: str) -> TableOverride:
        """The normalised override of ``table`` (an empty one when there is none)."""
        rule = self.per_table.get(table)
        if rule is None:
            return TableOverride()
        if isinstance(rule, TableOverride):
            return rule
        if rule == "dense":
            return TableOverride(dense=True)
        if rule == "compress":
            return TableOverride(dense=False)
        if isinstance(rule, int) and not isinstance(rule, bool):
            return TableOverride(rank=rule)
        raise ValueError(
            f"CompressionPolicy.per_table[{table!r}]: expected a TableOverride, 'dense', 'compress' "
            f"or an int rank, got {rule!r}"
        )

    def table_rank(self, table: str) -> int:
        """The rank ``table`` asks for: its override's, else the policy's."""
        rank = self.override(table).rank
        return rank if rank is not None else self.rank

    @property
    def mlp_rank(self) -> int:
        return self.linear_rank if self.linear_rank is not None else self.rank

    @property
    def mlp_min_gain(self) -> float:
        """The parameter ratio MLP and cross-net layers need: ``linear_min_gain``, else ``min_gain``."""
        return self.linear_min_gain if self.linear_min_gain is not None else self.min_gain


@dataclass(frozen=True)
class TablePlan:
    """The decision for one table: dense, or TTM with a shape and ranks."""

    name: str
    compressed: bool
    shape: Shape | None = None
    ranks: tuple[int, ...] | None = None
    reason: str = ""
    """Why the table stays dense (empty when it is compressed)."""

    def group_key(self, embedding_dim: int) -> tuple:
        """Tables with equal keys are stacked and looked up in one call."""
        return (self.shape, self.ranks, embedding_dim)


def ttm_num_parameters(shape: Shape, ranks: Sequence[int]) -> int:
    """Core and controller entries of one TTM table."""
    full = [1, *ranks, 1]
    cores = sum(full[k] * n * m * full[k + 1] for k, (n, m) in enumerate(zip(*shape)))
    return cores + sum(ranks)


def _default_shape(num_embeddings: int, embedding_dim: int, rank: int, two_cores_within: float) -> Shape:
    """:func:`ttm_shape`'s shape, or 2 cores when they cost at most ``two_cores_within`` times its parameters."""
    shape = ttm_shape(num_embeddings, embedding_dim, rank)
    if len(shape[0]) == 2 or two_cores_within <= 0:
        return shape
    two = ttm_shape(num_embeddings, embedding_dim, rank, num_cores=2)

    def size(s: Shape) -> int:
        modes = [n * m for n, m in zip(*s)]
        return ttm_num_parameters(s, cap_ranks([rank] * (len(modes) - 1), modes))

    return two if size(two) <= two_cores_within * size(shape) else shape


def plan_table(name: str, num_embeddings: int, embedding_dim: int, policy: CompressionPolicy) -> TablePlan:
    """Decide how one table is stored.

    Example::

        >>> plan_table("t", 1_000_000, 16, CompressionPolicy(rank=8)).shape
        ((100, 100, 100), (2, 2, 4))
    """
    rule = policy.override(name)
    if rule.dense is True:
        return TablePlan(name, compressed=False, reason="the policy's per_table entry says dense")
    rank = policy.table_rank(name)
    if rule.shape is not None:
        rows = check_shape(f"table {name!r} rows", num_embeddings, rule.shape[0])
        cols = check_shape(f"table {name!r} columns", embedding_dim, rule.shape[1])
        if len(rows) != len(cols) or not 2 <= len(rows) <= 4:
            raise ValueError(
                f"table {name!r}: row and column shapes need the same number (2-4) of factors, "
                f"got {list(rows)} and {list(cols)}"
            )
        shape: Shape = (tuple(rows), tuple(cols))
    else:
        shape = _default_shape(num_embeddings, embedding_dim, rank, policy.two_cores_within)
    modes = [n * m for n, m in zip(*shape)]
    ranks = tuple(cap_ranks(check_rank(f"table {name!r}", rank, len(modes) - 1), modes))
    if rule.dense is False:
        return TablePlan(name, True, shape, ranks)
    if num_embeddings < policy.min_rows_to_compress:
        return TablePlan(
            name, compressed=False, reason=f"{num_embeddings} rows < min_rows_to_compress={policy.min_rows_to_compress}"
        )
    if num_embeddings * embedding_dim < policy.min_params_to_compress:
        return TablePlan(
            name,
            compressed=False,
            reason=f"{num_embeddings * embedding_dim} parameters < "
            f"min_params_to_compress={policy.min_params_to_compress}",
        )
    gain = num_embeddings * embedding_dim / ttm_num_parameters(shape, ranks)
    if gain < policy.min_gain:
        return TablePlan(
            name,
            compressed=False,
            reason=f"TT at rank {rank} would be only {gain:.2f}x smaller < min_gain={policy.min_gain}",
        )
    return TablePlan(name, True, shape, ranks)


def plan_tables(tables: Sequence[tuple[str, int, int]], policy: CompressionPolicy) -> dict[str, TablePlan]:
    """Plan every table, then give tables of similar size one shared TT shape.

    Args:
        tables: ``(name, num_embeddings, embedding_dim)`` of each table.
        policy: the compression policy (``share_shapes_within`` sets how similar is similar).

    Returns:
        Plans by table name.

    Example::

        >>> plans = plan_tables([("a", 1_000_000, 16), ("b", 600_000, 16), ("c", 70_000, 16)],
        ...                     CompressionPolicy(rank=8))
        >>> plans["a"].shape == plans["b"].shape != plans["c"].shape
        True
    """
    plans = {name: plan_table(name, rows, dim, policy) for name, rows, dim in tables}
    if policy.share_shapes_within <= 0:
        return plans

    # largest first: each table joins the class of the first leader with as many cores
    # whose shape costs it at most share_shapes_within times its own parameters
    shareable = sorted(
        (
            (rows, dim, name)
            for name, rows, dim in tables
            if plans[name].compressed and policy.override(name).shape is None
        ),
        reverse=True,
    )
    leaders: list[tuple[int, str]] = []
    for rows, dim, name in shareable:
        plan = plans[name]
        own = ttm_num_parameters(plan.shape, plan.ranks)
        for lead_dim, lead in leaders:
            lead_plan = plans[lead]
            alike = lead_dim == dim and policy.table_rank(lead) == policy.table_rank(name)
            if not alike or len(lead_plan.shape[0]) != len(plan.shape[0]):
                continue
            # the lead's shape must hold this table's rows (it does: the lead is larger)
            if ttm_num_parameters(lead_plan.shape, lead_plan.ranks) <= policy.share_shapes_within * own:
                plans[name] = TablePlan(name, True, lead_plan.shape, lead_plan.ranks)
                break
        else:
            leaders.append((dim, name))
    return plans


def tt_linear_num_parameters(in_features: int, out_features: int, rank: int, bias: bool = True) -> int:
    """Parameters of a ``TTLinear`` with the default shape at ``rank`` (cores, controllers, bias)."""
    in_shape, out_shape = tt_linear_shapes(in_features, out_features)
    modes = list(in_shape) + list(out_shape)
    ranks = cap_ranks([rank] * (len(modes) - 1), modes)
    full = [1, *ranks, 1]
    cores = sum(full[k] * n * full[k + 1] for k, n in enumerate(modes))
    return cores + sum(ranks) + (out_features if bias else 0)


def linear_pays(in_features: int, out_features: int, rank: int, min_gain: float, bias: bool = True) -> bool:
    """Whether a TT layer at ``rank`` pays: ``min_gain`` times fewer parameters than the dense
    layer, and no more multiply-adds per row (``r (in + out)`` for the two skinny GEMMs,
    ``r`` the middle rank, against ``in * out``). ``min_gain <= 0`` compresses every layer.

    Example::

        >>> linear_pays(512, 256, 16, 2.0), linear_pays(13, 16, 16, 2.0), linear_pays(13, 512, 32, 2.0)
        (True, False, False)
    """
    if min_gain <= 0:
        return True
    dense = in_features * out_features + (out_features if bias else 0)
    if dense < min_gain * tt_linear_num_parameters(in_features, out_features, rank, bias):
        return False
    in_shape, out_shape = tt_linear_shapes(in_features, out_features)
    modes = list(in_shape) + list(out_shape)
    middle = cap_ranks([rank] * (len(modes) - 1), modes)[len(in_shape) - 1]
    return middle * (in_features + out_features) <= in_features * out_features
