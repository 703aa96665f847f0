"""TTMEmbeddingBag: an embedding bag whose table is a tensor-train matrix (TTM)."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from comera_rec.tensor import kernels
from comera_rec.tensor.contract import ttm_dense_table, ttm_embedding_bag
from comera_rec.tensor.derived import derived_cache, scoring_cache_on
from comera_rec.tensor.shapes import check_shape, default_num_cores, factorize, ttm_row_shape
from comera_rec.tensor.svd import tt_svd
from comera_rec.tensor.train import TensorTrainModule, cap_ranks, check_float_dtype, check_rank
from comera_rec.tensor.validation import check_bags, check_rank_argument

POOLING_MODES = ("sum", "mean")


def ttm_shape(
    num_embeddings: int,
    embedding_dim: int,
    rank: int,
    num_cores: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Default ``(row_factors, column_factors)`` of a TTM table.

    Example::

        >>> ttm_shape(10131227, 16, 32)
        ((59, 53, 54, 60), (2, 2, 2, 2))
    """
    d = num_cores or max(2, default_num_cores(num_embeddings))
    cols = factorize(embedding_dim, d)
    return ttm_row_shape(num_embeddings, cols, rank), cols


def set_static_shapes(model: nn.Module, enabled: bool = True) -> int:
    """Switch every TTM lookup in ``model`` to (or back from) static shapes.

    Static shapes make a lookup capturable in a CUDA graph: no ``torch.unique``, no host
    synchronisation, output shapes that depend on the input shapes only (see
    :func:`~comera_rec.tensor.contract.ttm_embedding_bag_static`). They also turn off
    the input checks, which read ids on the host: :class:`TTMEmbeddingBag` skips
    ``check_bags`` and ``TTMEmbeddingBagCollection`` its id and layout validation, so
    out-of-range ids are not reported. Every submodule with a ``static_shapes``
    attribute is switched (:class:`TTMEmbeddingBag`, ``StackedTTMTables``,
    ``TTMEmbeddingBagCollection``); the attribute is not part of the state dict.

    Args:
        model: any module.
        enabled: the value to set.

    Returns:
        The number of modules switched.

    Example::

        >>> model = nn.Sequential(TTMEmbeddingBag(100, 8, rank=4), nn.Linear(8, 1))
        >>> set_static_shapes(model)
        1
        >>> model[0].static_shapes
        True
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "static_shapes"):
            module.static_shapes = bool(enabled)
            count += 1
    return count


class TTMEmbeddingBag(TensorTrainModule):
    """``nn.EmbeddingBag`` (``include_last_offset=True``) with a TTM table.

    The table ``(num_embeddings, embedding_dim)`` is a train of ``d`` cores
    ``(r_{k-1}, n_k, m_k, r_k)``, ``n_1...n_d >= num_embeddings`` and
    ``m_1...m_d >= embedding_dim``, with a rank controller on each internal bond.
    Lookups de-duplicate ids and the prefixes / suffixes of their core slices
    (see :func:`comera_rec.tensor.contract.ttm_rows`); the table is never formed.

    Args:
        num_embeddings: rows of the table.
        embedding_dim: columns of the table.
        rank: rank of every internal bond, or one per bond (``d - 1`` values).
        mode: ``"sum"`` or ``"mean"`` pooling.
        shape: ``(row_factors, column_factors)``, 2 to 4 each and equally many; chosen
            by :func:`ttm_shape` when ``None``.
        device: where to allocate (``"meta"`` allocates nothing).
        dtype: floating point dtype.

    Attributes:
        static_shapes: look up with :func:`~comera_rec.tensor.contract.ttm_embedding_bag_static`
            semantics (no de-duplication, no host synchronisation, no id checks), for
            CUDA-graph capture; ``False`` by default. Set it with :func:`set_static_shapes`.

    Example::

        >>> bag = TTMEmbeddingBag(10_000, 16, rank=8)
        >>> ids, offsets = torch.tensor([1, 2, 9999]), torch.tensor([0, 2, 3])
        >>> bag(ids, offsets).shape
        torch.Size([2, 16])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        rank: int | Sequence[int],
        *,
        mode: str = "sum",
        shape: tuple[Sequence[int], Sequence[int]] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dtype = check_float_dtype("TTMEmbeddingBag", dtype)
        rank = check_rank_argument("TTMEmbeddingBag", rank)
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TTMEmbeddingBag: {name} must be a positive integer, got {value!r}")
        if mode not in POOLING_MODES:
            raise ValueError(f"TTMEmbeddingBag: mode must be one of {POOLING_MODES}, got {mode!r}")
        if shape is None:
            first_rank = rank if isinstance(rank, int) else max(rank)
            row_shape, col_shape = ttm_shape(num_embeddings, embedding_dim, first_rank)
        else:
            row_shape = check_shape("TTMEmbeddingBag rows", num_embeddings, shape[0])
            col_shape = check_shape("TTMEmbeddingBag columns", embedding_dim, shape[1])
            if len(row_shape) != len(col_shape) or not 2 <= len(row_shape) <= 4:
                raise ValueError(
                    f"TTMEmbeddingBag: row and column shapes need the same number (2-4) of factors, "
                    f"got {list(row_shape)} and {list(col_shape)}"
                )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.static_shapes = False
        self.row_shape: tuple[int, ...] = tuple(row_shape)
        self.col_shape: tuple[int, ...] = tuple(col_shape)
        modes = [n * m for n, m in zip(self.row_shape, self.col_shape)]
        ranks = cap_ranks(check_rank("TTMEmbeddingBag", rank, len(modes) - 1), modes)
        full = [1] + ranks + [1]
        self._init_train(
            core_shapes=[(full[k], self.row_shape[k], self.col_shape[k], full[k + 1]) for k in range(len(modes))],
            num_batch_dims=0,
            controller_shapes=[(r,) for r in ranks],
            device=device,
            dtype=dtype,
        )
        self.reset_parameters()

    @property
    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.row_shape, self.col_shape

    def reset_parameters(self) -> None:
        """Initialise like TorchRec's tables: entries of variance 1 / (3 num_embeddings)."""
        self._init_cores_normal(target_std=math.sqrt(1.0 / (3.0 * self.num_embeddings)))

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pool the rows of ``input`` into bags.

        Args:
            input: ``(N,)`` ids in ``[0, num_embeddings)``.
            offsets: ``(B + 1,)`` bag boundaries (``include_last_offset=True``).
            per_sample_weights: optional ``(N,)`` weights.

        Returns:
            ``(B, embedding_dim)``; on the ``meta`` device when the table or the inputs are
            (shapes only, as torch's modules do: nothing is computed or range-checked).
        """
        meta = input.is_meta or offsets.is_meta or self.cores[0].is_meta
        if meta:  # only dtypes and shapes can be checked: a meta tensor has no values
            check_bags("TTMEmbeddingBag", input, offsets, self.num_embeddings, per_sample_weights)
            input, offsets = input.to("meta"), offsets.to("meta")
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.to("meta")
        elif not self.static_shapes:  # the checks read ids on the host: not under static shapes
            check_bags("TTMEmbeddingBag", input, offsets, self.num_embeddings, per_sample_weights)
        batch = (self.row_shape, self.embedding_dim, input.long(), offsets.long(), self.mode, per_sample_weights)
        if not meta and not self.static_shapes and scoring_cache_on():
            # scoring on CPU: whole halves kept on the parameters (a stack of one table), two
            # rows of them per id; the cores as a stack, read for their shapes only
            cores = [c.unsqueeze(0) for c in self.cores._parameters.values()]
            halves = kernels.ttm_cpu.kept_whole_halves(
                self, self.train_tensors(), cores, input, lambda: [c.unsqueeze(0) for c in self._fold_controllers()]
            )
            if halves is not None:
                return kernels.ttm_embedding_bag_cpu(cores, *batch, halves=halves)
        if meta:
            cores = [c.unsqueeze(0).to(input.device) for c in self.scaled_cores()]  # (1, r, n, m, r')
        else:  # the same tensors every call, so what the lookup keeps for them (GPU scoring) is found
            cores = list(
                derived_cache(self, "stacked_cores").get(
                    self.train_tensors(), lambda: [c.unsqueeze(0) for c in self.scaled_cores()]
                )
            )
        # on meta the static path: the dynamic one de-duplicates ids with torch.unique,
        # which has no meta kernel; both give the same shapes
        return ttm_embedding_bag(cores, *batch, static_shapes=self.static_shapes or meta)

    def dense_weight(self) -> torch.Tensor:
        """The ``(num_embeddings, embedding_dim)`` table, differentiable in the cores.

        This forms the whole table: meant for tests and export, not for training.
        """
        cores = [c.unsqueeze(0) for c in self.scaled_cores()]
        return ttm_dense_table(cores)[: self.num_embeddings, : self.embedding_dim]

    def dense_num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, shape={self.shape}, ranks={self.ranks}"
        )

    @classmethod
    def from_embedding(
        cls,
        weight: torch.Tensor,
        rank: int | Sequence[int],
        *,
        mode: str = "sum",
        shape: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> "TTMEmbeddingBag":
        """Convert a dense ``(num_embeddings, embedding_dim)`` table by TT-SVD.

        Exact at full rank. Large tables go through small Gram matrices, never through
        an SVD of the whole table.

        Example::

            >>> table = torch.randn(100, 8)
            >>> bag = TTMEmbeddingBag.from_embedding(table, rank=64)
            >>> torch.allclose(bag.dense_weight(), table, atol=1e-4)
            True
        """
        if weight.dim() != 2:
            raise ValueError(f"TTMEmbeddingBag.from_embedding: expected a 2-D table, got shape {tuple(weight.shape)}")
        w = weight.detach()
        num_embeddings, embedding_dim = w.shape
        bag = cls(num_embeddings, embedding_dim, rank, mode=mode, shape=shape, device="meta", dtype=w.dtype)
        rows, cols = bag.row_shape, bag.col_shape
        padded = F.pad(w, (0, math.prod(cols) - embedding_dim, 0, math.prod(rows) - num_embeddings))
        d = len(rows)
        # (n_1..n_d, m_1..m_d) -> (n_1, m_1, ..., n_d, m_d) -> one mode per core
        interleaved = (
            padded.reshape(rows + cols)
            .permute(*[i for k in range(d) for i in (k, d + k)])
            .reshape([n * m for n, m in zip(rows, cols)])
        )
        cores = tt_svd(interleaved, bag.ranks)
        bag.cores = nn.ParameterList(
            [
                nn.Parameter(c.reshape(c.shape[0], rows[k], cols[k], c.shape[-1]).to(w.device))
                for k, c in enumerate(cores)
            ]
        )
        bag.controllers = nn.ParameterList(
            [nn.Parameter(torch.ones(c.shape[-1], device=w.device, dtype=w.dtype)) for c in cores[:-1]]
        )
        return bag
