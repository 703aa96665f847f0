"""The output layout of :class:`~comera_rec.integration.collection.TTMEmbeddingBagCollection`
and the check of its input ``KeyedJaggedTensor``.

:class:`BagOutputLayout` (frozen, made once in the collection's ``__init__``) says which
keys the output has, in TorchRec's order, how wide each is and where its bags come from (a
stream of a TTM group, or an output of the dense child). :func:`check_jagged_batch` is the
collection's input validation: integer ids and lengths, lengths / offsets / values that
agree, and every id in its table's range, each error naming the feature.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.integration.policy import TablePlan
from comera_rec.tensor import kernels

COLLECTION_NAME = "TTMEmbeddingBagCollection"  # what the errors name


@dataclass(frozen=True)
class BagOutputLayout:
    """Where each output key of a bag collection comes from, in TorchRec's order.

    Attributes:
        embedding_names: the output keys, as TorchRec's ``EmbeddingBagCollection`` names
            them (``feature@table`` for a feature read by several tables).
        lengths_per_embedding: each key's width (its table's ``embedding_dim``).
        slots: per key, ``("tt", group, stream)`` (stream ``stream`` of TTM group
            ``group``) or ``("dense", i, 0)`` (the dense child's ``i``-th output).
        uniform_dim: all keys have one width (set from ``lengths_per_embedding``).

    Example::

        >>> layout = BagOutputLayout(("f0", "f1"), (4, 4), (("tt", 0, 0), ("dense", 0, 0)))
        >>> layout.uniform_dim, layout.column_blocks(has_dense=True)
        (True, [(1, 0), (0, 0)])
    """

    embedding_names: tuple[str, ...]
    lengths_per_embedding: tuple[int, ...]
    slots: tuple[tuple[str, int, int], ...]
    uniform_dim: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "uniform_dim", len(set(self.lengths_per_embedding)) == 1)

    @classmethod
    def from_tables(
        cls,
        tables: Sequence[EmbeddingBagConfig],
        plans: Mapping[str, TablePlan],
        group_tables: Sequence[Sequence[str]],
        group_streams: Sequence[Sequence[tuple[str, int, bool]]],
    ) -> "BagOutputLayout":
        """The layout of a collection's tables.

        Args:
            tables: the table configs, in the collection's order (``feature_names`` set).
            plans: each table's plan (only ``compressed`` is read).
            group_tables: per TTM group, its table names in stacking order.
            group_streams: per TTM group, ``(feature, table index in the stack, is mean)``
                of each bag stream; the dense outputs follow the dense tables' order.

        Returns:
            The :class:`BagOutputLayout`.
        """
        embedding_names = tuple(itertools.chain(*get_embedding_names_by_table(list(tables))))
        lengths = tuple(t.embedding_dim for t in tables for _ in t.feature_names)
        dense_pos = itertools.count()
        stream_pos: dict[tuple[str, str], tuple[int, int]] = {}
        for g, streams in enumerate(group_streams):
            for s, (f, i, _) in enumerate(streams):
                stream_pos[(group_tables[g][i], f)] = (g, s)
        slots: list[tuple[str, int, int]] = []
        for t in tables:
            for f in t.feature_names:
                if plans[t.name].compressed:
                    g, s = stream_pos[(t.name, f)]
                    slots.append(("tt", g, s))
                else:
                    slots.append(("dense", next(dense_pos), 0))
        return cls(embedding_names, lengths, tuple(slots))

    def column_blocks(self, has_dense: bool) -> list[tuple[int, int]]:
        """``(source, first column)`` of each key's block, for
        :func:`~comera_rec.tensor.kernels.gather_column_blocks` (one width for all keys).

        Args:
            has_dense: source 0 is the dense child's ``(B, dense width)`` values; each TTM
                group's ``(B, F_g * D)`` follows (from source 0 when there is no dense child).

        Returns:
            One ``(source, column)`` per output key, in output order.
        """
        dim = self.lengths_per_embedding[0]
        first_group = 1 if has_dense else 0
        return [(first_group + a, b * dim) if kind == "tt" else (0, a * dim) for kind, a, b in self.slots]

    def stream_columns(self, num_groups: int) -> tuple[list[int], list[list[int]]]:
        """Where each lookup's bags go in the output (one width for all keys): ``(dense,
        groups)``, ``dense[a]`` the first column of the dense child's feature ``a``,
        ``groups[g][s]`` that of TTM group ``g``'s stream ``s``. For lookups that write
        their bags into one output (no gather after).

        Example::

            >>> layout = BagOutputLayout(("a", "b", "c"), (4, 4, 4), (("tt", 0, 1), ("dense", 0, 0), ("tt", 0, 0)))
            >>> layout.stream_columns(1)
            ([4], [[8, 0]])
        """
        dim = self.lengths_per_embedding[0]
        dense: dict[int, int] = {}
        groups: list[dict[int, int]] = [{} for _ in range(num_groups)]
        for k, (kind, a, b) in enumerate(self.slots):
            if kind == "tt":
                groups[a][b] = k * dim
            else:
                dense[a] = k * dim
        return [dense[a] for a in range(len(dense))], [[g[s] for s in range(len(g))] for g in groups]


def one_batch_size(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A KJT of variable batch sizes per feature (TorchRec's VBE: feature ``f`` has its own
    bags, and ``inverse_indices`` say which of them each of the ``B`` samples reads) as the
    KJT of one batch size ``B`` it stands for: sample ``b``'s bag of feature ``f`` is bag
    ``inverse_indices[f][b]``, ids and weights copied. Pooling those bags gives what
    TorchRec's ``EmbeddingBagCollection`` gives for the VBE input (it pools each feature's
    own bags, then selects them by the inverse indices), and the gradients of a repeated
    bag sum, as there.

    Args:
        features: a KJT with ``variable_stride_per_key()`` and ``inverse_indices``.

    Returns:
        The same keys, ``B`` bags each, ``B`` the inverse indices' width.

    Raises:
        ValueError: no inverse indices, or none for one of the keys.

    Example::

        >>> vbe = KeyedJaggedTensor(
        ...     keys=["user", "item"], values=torch.tensor([7, 8, 1, 2, 3]), lengths=torch.tensor([2, 1, 1, 1]),
        ...     stride_per_key_per_rank=[[1], [3]], inverse_indices=(["user", "item"], torch.tensor([[0, 0], [2, 1]])))
        >>> one = one_batch_size(vbe)
        >>> one.stride(), one.lengths().tolist(), one.values().tolist()
        (2, [2, 2, 1, 1], [7, 8, 7, 8, 3, 2])
    """
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(
            f"{COLLECTION_NAME}: a KeyedJaggedTensor of variable batch sizes per feature needs inverse_indices "
            "(which of each feature's bags every sample reads), as TorchRec's EmbeddingBagCollection does"
        )
    names, index = inverse
    row = {name: i for i, name in enumerate(names)}
    missing = [key for key in features.keys() if key not in row]
    if missing:
        raise ValueError(f"{COLLECTION_NAME}: the inverse_indices have no row for feature(s) {missing}")
    batch = index.shape[1]
    weighted = features.weights_or_none() is not None
    values, lengths, weights = [], [], []
    for key, bags in features.to_dict().items():
        pick = index[row[key]].long()  # (B,): each sample's bag of this feature
        offsets = bags.offsets()
        lens = bags.lengths()[pick]
        total = int(lens.sum())
        sample = torch.repeat_interleave(torch.arange(batch, device=lens.device), lens, output_size=total)
        starts = offsets[:-1][pick] - (torch.cumsum(lens, 0) - lens)  # (B,): source start - new start
        at = torch.arange(total, device=lens.device) + starts[sample]  # each new id's source position
        values.append(bags.values()[at])
        lengths.append(lens)
        if weighted:
            weights.append(bags.weights()[at])
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weighted else None,
        stride=batch,
    )


def check_input_kind(features: object, dense: object) -> None:
    """The input is a ``KeyedJaggedTensor`` of one batch size for all features, and the
    train pipeline will not free it before the TTM tables read it.

    Args:
        features: the collection's input.
        dense: the collection's dense child (``None`` when it has none).

    Raises:
        TypeError: not a ``KeyedJaggedTensor``.
        ValueError: variable batch sizes per feature.
        RuntimeError: the dense child's ``free_features_storage_early`` is on.
    """
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"{COLLECTION_NAME}: expected a KeyedJaggedTensor, got {type(features).__name__}")
    if features.variable_stride_per_key():  # (forward makes them one batch size, see one_batch_size)
        raise ValueError(f"{COLLECTION_NAME}: variable batch sizes per feature reached the lookups")
    if getattr(dense, "_free_features_storage_early", False):
        raise RuntimeError(
            f"{COLLECTION_NAME}: the train pipeline's free_features_storage_early=True frees the "
            "batch's KeyedJaggedTensor after the dense tables' input distribution, but the TTM tables "
            "read it later in the forward; leave free_features_storage_early off"
        )


def id_range_error(
    key: str, values: torch.Tensor, pos: int, bounds_by_feature: Mapping[str, tuple[int, str]]
) -> ValueError:
    """The error for id ``values[pos]`` of feature ``key`` out of its table's range.

    Args:
        key: the feature.
        values: the KJT's ids.
        pos: the position of the bad id in ``values``.
        bounds_by_feature: feature -> ``(id bound, table name)``.

    Returns:
        A ``ValueError`` naming the feature, the id, the range and the table.
    """
    num, table = bounds_by_feature[key]
    return ValueError(
        f"{COLLECTION_NAME}: feature {key!r} has id {int(values[pos])} out of range [0, {num}) of table {table!r}"
    )


def check_jagged_batch(
    features: KeyedJaggedTensor,
    keys: Sequence[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    bounds: list[int],
    bounds_by_feature: Mapping[str, tuple[int, str]],
) -> None:
    """Integer ids and lengths, lengths / offsets / values that agree, ids in range
    (errors name the feature). On CPU with the kernels built, one C++ pass
    (``kernels.check_jagged``) does what the tensor checks do in several.

    Args:
        features: the input KJT (its stride, offsets and weights are read).
        keys: its keys.
        values: its values (the ids).
        lengths: its lengths, ``(len(keys) * stride,)``.
        bounds: per key, ids must lie in ``[0, bound)``; -1 leaves the key unchecked.
        bounds_by_feature: feature -> ``(id bound, table name)``, for the errors.

    Raises:
        TypeError: ids or lengths that are not integers.
        ValueError: a layout that does not hold together, or an id out of range.
    """
    name = COLLECTION_NAME
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise TypeError(f"{name}: KeyedJaggedTensor values (ids) must be an integer tensor, got {values.dtype}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name}: KeyedJaggedTensor lengths must be an integer tensor, got {lengths.dtype}")
    batch = features.stride()
    if values.dim() != 1 or lengths.dim() != 1:
        raise ValueError(
            f"{name}: KeyedJaggedTensor values and lengths must be 1-D, got shapes "
            f"{tuple(values.shape)} and {tuple(lengths.shape)}"
        )
    if lengths.numel() != len(keys) * batch:
        raise ValueError(
            f"{name}: KeyedJaggedTensor has {lengths.numel()} lengths, expected "
            f"{len(keys)} keys x batch {batch} = {len(keys) * batch}"
        )

    def where(pos: int) -> str:
        return f"feature {keys[pos // batch]!r}, sample {pos % batch}" if batch else f"position {pos}"

    def negative_length(pos: int) -> ValueError:
        return ValueError(f"{name}: negative bag length {int(lengths[pos])} at {where(pos)}")

    def wrong_total(total: int) -> ValueError:
        return ValueError(
            f"{name}: KeyedJaggedTensor lengths sum to {total} but it holds {values.numel()} "
            f"values (ids); lengths and values disagree"
        )

    def offsets_differ(pos: int) -> ValueError:
        return ValueError(
            f"{name}: KeyedJaggedTensor offsets and lengths disagree at {where(pos)}: "
            f"offsets give {int(offsets[pos + 1] - offsets[pos])}, lengths {int(lengths[pos])}"
        )

    offsets = features.offsets_or_none() if features.lengths_or_none() is not None else None
    if offsets is not None and (offsets.numel() != lengths.numel() + 1 or (offsets.numel() and int(offsets[0]) != 0)):
        raise ValueError(
            f"{name}: KeyedJaggedTensor offsets (length {offsets.numel()}, first "
            f"{int(offsets[0]) if offsets.numel() else None}) do not match its "
            f"{lengths.numel()} lengths (need {lengths.numel() + 1} offsets starting at 0)"
        )
    weights = features.weights_or_none()
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(f"{name}: KeyedJaggedTensor has {weights.numel()} weights for {values.numel()} values")
    one_pass = values.dtype in (torch.int32, torch.int64) and values.device.type == "cpu"
    if one_pass and lengths.device.type == "cpu" and kernels.cpu_kernel_enabled():
        code, pos, total, key = kernels.check_jagged(values, lengths, offsets, batch, bounds)
        if code == 1:
            raise negative_length(pos)
        if total != values.numel():
            raise wrong_total(total)
        if code == 2:
            raise offsets_differ(pos)
        if code == 3:
            raise id_range_error(keys[key], values, pos, bounds_by_feature)
        return
    if lengths.numel():
        negative = (lengths < 0).nonzero()
        if negative.numel():
            raise negative_length(int(negative[0]))
    total = int(lengths.sum()) if lengths.numel() else 0
    if total != values.numel():
        raise wrong_total(total)
    if offsets is not None:
        differ = (offsets[1:] - offsets[:-1] != lengths).nonzero()
        if differ.numel():
            raise offsets_differ(int(differ[0]))
    if values.numel() == 0:
        return
    length_per_key = features.length_per_key()
    limit = torch.repeat_interleave(
        torch.tensor(bounds, device=values.device), torch.tensor(length_per_key, device=values.device)
    )
    bad = (values < 0) | ((values >= limit) & (limit >= 0))
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        starts = list(itertools.accumulate([0] + length_per_key[:-1]))
        raise id_range_error(keys[bisect.bisect_right(starts, pos) - 1], values, pos, bounds_by_feature)
