"""StackedTTMTables: several TTM tables of one shape, stored as stacked cores and looked
up together in one call.

Tables whose TT shape (row factors, column factors, ranks) agree are stored as one
train with a leading table dimension: cores ``(T, r_{k-1}, n_k, m_k, r_k)`` and
controllers ``(T, r_k)``. A lookup over ids of all T tables is one call to
:func:`comera_rec.tensor.contract.ttm_embedding_bag` with a per-id table index, so
the cost of many small tables is that of one batched contraction, not of a Python loop.
A rank slice is cut by :meth:`truncate_ranks` only when it is dead in every table.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from comera_rec.tensor import kernels
from comera_rec.tensor.contract import ttm_dense_table, ttm_embedding_bag
from comera_rec.tensor.embedding import TTMEmbeddingBag
from comera_rec.tensor.halves import split_point
from comera_rec.tensor.shapes import check_shape
from comera_rec.tensor.train import TensorTrainModule, cap_ranks, check_float_dtype, check_rank
from comera_rec.tensor.validation import check_rank_argument


class StackedTTMTables(TensorTrainModule):
    """T TTM tables of equal shape with stacked cores (``num_batch_dims=1``).

    Args:
        num_embeddings: rows of each table (each at most ``prod(row_shape)``).
        embedding_dim: columns of every table (at most ``prod(col_shape)``).
        rank: rank of every internal bond, or one per bond (``d - 1`` values).
        row_shape: row factors ``(n_1..n_d)``, 2 to 4 of them.
        col_shape: column factors ``(m_1..m_d)``, as many as ``row_shape``.
        device: where to allocate (``"meta"`` allocates nothing).
        dtype: floating point dtype.

    Attributes:
        static_shapes: look up without de-duplication or host synchronisation, for
            CUDA-graph capture (see :func:`~comera_rec.tensor.embedding.set_static_shapes`);
            ``False`` by default.

    Example::

        >>> tables = StackedTTMTables([1000, 900], 16, 8, row_shape=(10, 10, 10), col_shape=(2, 2, 4))
        >>> ids, offsets = torch.tensor([3, 999, 5]), torch.tensor([0, 2, 3])
        >>> trains = torch.tensor([0, 0, 1])  # bag 0 reads table 0, bag 1 table 1
        >>> tables(ids, offsets, trains).shape
        torch.Size([2, 16])
    """

    def __init__(
        self,
        num_embeddings: Sequence[int],
        embedding_dim: int,
        rank: int | Sequence[int],
        *,
        row_shape: Sequence[int],
        col_shape: Sequence[int],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dtype = check_float_dtype("StackedTTMTables", dtype)
        rank = check_rank_argument("StackedTTMTables", rank)
        sizes = [int(v) for v in num_embeddings]
        if not sizes or any(v < 1 for v in sizes):
            raise ValueError(f"StackedTTMTables: num_embeddings must be positive integers, got {list(num_embeddings)}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"StackedTTMTables: embedding_dim must be a positive integer, got {embedding_dim!r}")
        rows = check_shape("StackedTTMTables rows", max(sizes), row_shape)
        cols = check_shape("StackedTTMTables columns", embedding_dim, col_shape)
        if len(rows) != len(cols) or not 2 <= len(rows) <= 4:
            raise ValueError(
                f"StackedTTMTables: row and column shapes need the same number (2-4) of factors, "
                f"got {list(rows)} and {list(cols)}"
            )
        self.num_embeddings: list[int] = sizes
        self.embedding_dim = embedding_dim
        self.static_shapes = False
        self.row_shape: tuple[int, ...] = tuple(rows)
        self.col_shape: tuple[int, ...] = tuple(cols)
        modes = [n * m for n, m in zip(rows, cols)]
        ranks = cap_ranks(check_rank("StackedTTMTables", rank, len(modes) - 1), modes)
        full = [1] + ranks + [1]
        t = len(sizes)
        self._init_train(
            core_shapes=[(t, full[k], rows[k], cols[k], full[k + 1]) for k in range(len(modes))],
            num_batch_dims=1,
            controller_shapes=[(t, r) for r in ranks],
            device=device,
            dtype=dtype,
        )
        self.reset_parameters()

    @property
    def num_tables(self) -> int:
        return len(self.num_embeddings)

    @property
    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.row_shape, self.col_shape

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every table like TorchRec: entries of variance 1 / (3 num_embeddings)."""
        if any(c.is_meta for c in self.cores):
            return
        paths = math.prod(self.ranks)
        k = self.num_cores
        for t, v in enumerate(self.num_embeddings):
            std = (1.0 / (3.0 * v) / paths) ** (1.0 / (2 * k))
            for core in self.cores:
                core[t].normal_(0.0, std)
        for d in self.controllers:
            d.fill_(1.0)

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        trains: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        *,
        stream_batch: int = 0,
    ) -> torch.Tensor:
        """Sum-pool bags whose ids belong to the tables named by ``trains``.

        Ids are not range-checked here (the collection checks them per feature).

        Args:
            ids: ``(N,)`` int64 row ids.
            offsets: ``(B + 1,)`` bag boundaries (``include_last_offset=True``).
            trains: ``(N,)`` table index of each id.
            per_sample_weights: optional ``(N,)`` weights.
            stream_batch: see :func:`~comera_rec.tensor.contract.ttm_embedding_bag`.

        Returns:
            ``(B, embedding_dim)`` summed bags (``(stream_batch, B / stream_batch *
            embedding_dim)`` with ``stream_batch``).
        """
        halves = self._kept_halves(ids)
        batch = (self.row_shape, self.embedding_dim, ids, offsets, "sum", per_sample_weights, trains)
        if halves is not None:  # scoring on CPU: two rows of the kept halves per id
            cores = list(self.cores._parameters.values())  # read for their shapes only
            return kernels.ttm_embedding_bag_cpu(cores, *batch, stream_batch=stream_batch, halves=halves)
        if not torch.is_grad_enabled():  # folded once and kept while the cores do not change
            return ttm_embedding_bag(
                self.scaled_cores(), *batch, static_shapes=self.static_shapes, stream_batch=stream_batch
            )
        cores, middle = self.training_operands()
        return ttm_embedding_bag(
            cores, *batch, static_shapes=self.static_shapes, stream_batch=stream_batch, middle=middle
        )

    def forward_into(
        self,
        out: torch.Tensor,
        stream_cols: Sequence[int],
        ids: torch.Tensor,
        offsets: torch.Tensor,
        trains: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        *,
        stream_batch: int,
    ) -> torch.Tensor:
        """:meth:`forward`'s bags of ``stream_batch`` samples a stream, written into ``out``
        (``(stream_batch, C)``) in place, stream ``f``'s at columns ``stream_cols[f] ...``:
        for a caller that lays several lookups' bags side by side with no gather after. The
        fused CPU lookup only (:func:`~comera_rec.tensor.kernels.cpu_kernel_applies`, the
        caller checks), as in training (controllers applied as the kernel takes them).

        Returns:
            ``out``, whose gradient (in training) reaches whatever wrote it before whole:
            that op must read only columns no stream here writes.

        Example::

            >>> tables = StackedTTMTables([10, 12], 4, rank=3, row_shape=(3, 4), col_shape=(2, 2))
            >>> out = torch.zeros(2, 12)
            >>> ids, offsets, trains = torch.tensor([1, 5, 7, 2]), torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0, 0, 1, 1])
            >>> tables.forward_into(out, [8, 0], ids, offsets, trains, stream_batch=2).shape
            torch.Size([2, 12])
        """
        cores, middle = self.training_operands()
        return kernels.ttm_embedding_bag_cpu(
            cores,
            self.row_shape,
            self.embedding_dim,
            ids,
            offsets,
            "sum",
            per_sample_weights,
            trains,
            stream_batch=stream_batch,
            middle=middle,
            into=(out, stream_cols),
        )

    def training_operands(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(cores, middle)``: the cores with every controller folded in but the one of the
        bond between the two halves (:func:`~comera_rec.tensor.halves.split_point`), and that
        controller ``(T, r)``. The fused CPU lookup scales its distinct prefixes by it (a few
        thousand rows), not the ``(T, r, n, m, r)`` core beside it, forward and backward;
        the other paths fold it in (:func:`~comera_rec.tensor.contract.fold_middle`)."""
        bond = split_point(len(self.cores)) - 1
        return self._fold_controllers(skip=bond), self.controllers[bond]

    def _kept_halves(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Both whole halves while scoring on CPU, kept on the parameters themselves
        (:func:`~comera_rec.tensor.kernels.ttm_cpu.kept_whole_halves`); else ``None``."""
        if self.static_shapes:
            return None
        sources = self.train_tensors()
        cores = sources[: len(self.cores._parameters)]
        return kernels.ttm_cpu.kept_whole_halves(self, sources, cores, ids, self._fold_controllers)

    def dense_weight(self, table: int) -> torch.Tensor:
        """Table ``table`` as a dense ``(num_embeddings, embedding_dim)`` tensor (tests, export)."""
        full = ttm_dense_table(self.scaled_cores(), table)
        return full[: self.num_embeddings[table], : self.embedding_dim]

    def dense_num_parameters(self) -> int:
        return sum(self.num_embeddings) * self.embedding_dim

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"shape={self.shape}, ranks={self.ranks}"
        )

    @classmethod
    def from_embeddings(
        cls,
        weights: Sequence[torch.Tensor],
        rank: int | Sequence[int],
        *,
        row_shape: Sequence[int],
        col_shape: Sequence[int],
    ) -> "StackedTTMTables":
        """Stack dense tables converted one by one by TT-SVD (exact at full rank).

        Example::

            >>> a, b = torch.randn(100, 8), torch.randn(90, 8)
            >>> s = StackedTTMTables.from_embeddings([a, b], 64, row_shape=(10, 10), col_shape=(2, 4))
            >>> torch.allclose(s.dense_weight(1), b, atol=1e-4)
            True
        """
        if not weights:
            raise ValueError("StackedTTMTables.from_embeddings: need at least one table")
        dims = {tuple(w.shape[1:]) for w in weights}
        if len(dims) != 1 or any(w.dim() != 2 for w in weights):
            raise ValueError(
                f"StackedTTMTables.from_embeddings: tables must be 2-D with one embedding_dim, "
                f"got shapes {[tuple(w.shape) for w in weights]}"
            )
        shape = (tuple(row_shape), tuple(col_shape))
        bags = [TTMEmbeddingBag.from_embedding(w, rank, shape=shape) for w in weights]
        ref = weights[0]
        out = cls(
            [w.shape[0] for w in weights],
            ref.shape[1],
            bags[0].ranks,
            row_shape=row_shape,
            col_shape=col_shape,
            device="meta",
            dtype=ref.dtype,
        )
        for k in range(len(bags[0].cores)):
            core_shapes = {tuple(b.cores[k].shape) for b in bags}
            if len(core_shapes) != 1:
                raise ValueError(f"StackedTTMTables.from_embeddings: core {k} shapes differ: {core_shapes}")
        out.cores = nn.ParameterList(
            [nn.Parameter(torch.stack([b.cores[k].detach() for b in bags])) for k in range(len(bags[0].cores))]
        )
        out.controllers = nn.ParameterList(
            [
                nn.Parameter(torch.stack([b.controllers[k].detach() for b in bags]))
                for k in range(len(bags[0].controllers))
            ]
        )
        return out
