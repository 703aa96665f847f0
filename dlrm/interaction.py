"""A drop-in for TorchRec's dot ``InteractionArch`` with a cheaper backward.

TorchRec forms all pairwise dot products with one batched GEMM, then picks the upper
triangle by advanced indexing; the backward of that indexing is an ``index_put`` with
accumulation into a zeroed ``(B, F+1, F+1)`` grid, then the GEMM's two backward GEMMs.
Here the grid is read out of the pair gradients by one gather (each position names its
pair, the diagonal a zero column: no zero fill, no accumulation), and one batched GEMM
gives the features' gradient: with
``U`` the upstream gradient on the upper triangle, the gradient of ``<U, E E^T>`` is
``(U + U^T) E``, and the grid filled in both triangles is ``U + U^T``. Same values forward
(bit for bit), gradients equal up to rounding. On CPU a fused kernel
(``dlrm/interaction_cpu.cpp``, :mod:`comera_rec.dlrm.interaction_kernel`) does the whole of it, the
concatenations included, per sample in one pass (values and gradients equal up to
rounding).

Shapes in comments: B batch, F sparse features, D embedding dim, n = F + 1.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import InteractionDCNArch, SparseArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.dlrm.interaction_kernel import pairwise_dots_cpu, pairwise_kernel_applies
from comera_rec.integration.fused_tables import fused_tables_lookup, single_lookup
from comera_rec.tensor.kernels import float32_under_cpu_autocast


class _PairwiseDots(torch.autograd.Function):
    """``(B, n, D) -> (B, n (n - 1) / 2)``: the dot products of every pair i < j, row-major."""

    @staticmethod
    def forward(ctx, combined: torch.Tensor, upper: torch.Tensor, pair_of_cell: torch.Tensor) -> torch.Tensor:
        n = combined.shape[1]
        grid = torch.bmm(combined, combined.transpose(1, 2))  # (B, n, n)
        ctx.save_for_backward(combined, pair_of_cell)
        return grid.view(-1, n * n).index_select(1, upper)  # (B, pairs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        combined, pair_of_cell = ctx.saved_tensors
        n = combined.shape[1]
        # (i, j) and (j, i) both read pair (i, j); the diagonal reads the appended zero.
        # One gather writes every cell once: 0.35 ms where a zeroed grid and two
        # index_copy_ took 0.95 ms (B = 2048, n = 27)
        padded = nn.functional.pad(grad, (0, 1))  # (B, pairs + 1)
        grid = torch.gather(padded, 1, pair_of_cell.expand(grad.shape[0], -1))  # (B, n * n)
        # under autocast the forward's product ran in autocast's dtype, and so do the
        # gradient and this product (autograd casts the result back to the input's dtype)
        return torch.bmm(grid.view(-1, n, n), combined.to(grid.dtype)), None, None  # (B, n, D)


class PairwiseDotInteraction(nn.Module):
    """TorchRec's dot ``InteractionArch``: the dense features followed by the dot products
    of every pair among ``[dense, sparse_1 .. sparse_F]``, same output layout.

    Args:
        num_sparse_features: F.

    Example::

        >>> from torchrec.models.dlrm import InteractionArch
        >>> g = torch.Generator().manual_seed(0)
        >>> dense, sparse = torch.randn(4, 8, generator=g), torch.randn(4, 3, 8, generator=g)
        >>> ours = PairwiseDotInteraction(3)(dense, sparse)  # summed in another order: equal to rounding
        >>> ours.shape, torch.allclose(ours, InteractionArch(3)(dense, sparse), rtol=1e-6, atol=1e-6)
        (torch.Size([4, 14]), True)
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        if num_sparse_features < 1:
            raise ValueError(f"PairwiseDotInteraction: need at least one sparse feature, got {num_sparse_features}")
        self.num_sparse_features = num_sparse_features
        # per device, the flat positions of the pairs in the (n, n) grid: made on first use,
        # not buffers, so a model built on the meta device needs nothing materialised here
        self._positions: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _positions_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._positions.get(device)
        if hit is None:
            n = self.num_sparse_features + 1
            rows, cols = torch.triu_indices(n, n, offset=1, device=device)
            upper = rows * n + cols  # flat (i, j), i < j, in output order
            pairs = torch.arange(upper.numel(), device=device)
            pair_of_cell = torch.full((n * n,), upper.numel(), dtype=torch.long, device=device)
            pair_of_cell[upper] = pairs
            pair_of_cell[cols * n + rows] = pairs  # (j, i) reads the same pair
            hit = self._positions[device] = (upper, pair_of_cell)
        return hit

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """
        Args:
            dense_features: ``(B, D)``.
            sparse_features: ``(B, F, D)``.

        Returns:
            ``(B, D + F (F + 1) / 2)``.
        """
        if sparse_features.dim() != 3 or sparse_features.shape[1] != self.num_sparse_features:
            raise ValueError(
                f"PairwiseDotInteraction: expected sparse features (B, {self.num_sparse_features}, D), "
                f"got {tuple(sparse_features.shape)}"
            )
        # under CPU autocast the kernel takes the features in float32 (the bottom MLP's
        # last layer may have given bfloat16), as autocast's float32 operators do
        dense_features = float32_under_cpu_autocast(dense_features)
        sparse_features = float32_under_cpu_autocast(sparse_features)
        if pairwise_kernel_applies(dense_features, sparse_features):
            return pairwise_dots_cpu(dense_features, sparse_features)
        combined = torch.cat([dense_features.unsqueeze(1), sparse_features], dim=1)  # (B, n, D)
        upper, pair_of_cell = self._positions_on(combined.device)
        pairs = _PairwiseDots.apply(combined, upper, pair_of_cell)  # (B, n (n - 1) / 2)
        return torch.cat([dense_features, pairs], dim=1)


class FlatSparseArch(SparseArch):
    """TorchRec's ``SparseArch`` without the split and concatenation of its output when
    the collection's features already come in the arch's order with one dim: then the
    ``(B, F * D)`` values are the ``(B, F, D)`` result as they are (a view, no copy). A
    plain unsharded ``FusedEmbeddingBagCollection`` whose features the batch holds in
    that order is looked up through
    :func:`~comera_rec.integration.fused_tables.fused_tables_lookup` (the fused CPU
    row-wise Adagrad kernel where it applies; otherwise its FBGEMM lookup directly).

    Args:
        embedding_bag_collection: as for ``SparseArch``.

    Example::

        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        >>> ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=4,
        ...     num_embeddings=10, feature_names=[f"f{i}"]) for i in range(2)])
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(  # two samples, one id per feature
        ...     ["f0", "f1"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1]))
        >>> FlatSparseArch(ebc)(kjt).shape
        torch.Size([2, 2, 4])
    """

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``(B, F, D)`` pooled embeddings in ``sparse_feature_names`` order."""
        if isinstance(features, torch.fx.Proxy):  # FX tracing (TorchRec's pipelines): TorchRec's own path
            return super().forward(features)
        ebc = self.embedding_bag_collection
        lookup = single_lookup(ebc, features.keys()) if features.keys() == self.sparse_feature_names else None
        if lookup is not None and not features.variable_stride_per_key():
            # a plain fused collection reading the batch's features in order: its one
            # lookup takes the ids as they are (fused_tables_lookup)
            weights = features.weights_or_none() if ebc.is_weighted() else None
            values = fused_tables_lookup(lookup, features.values(), features.lengths(), weights, features.stride())
            return values.reshape(-1, self.F, self.D)
        sparse = ebc(features)
        if sparse.keys() == self.sparse_feature_names and all(n == self.D for n in sparse.length_per_key()):
            return sparse.values().reshape(-1, self.F, self.D)
        values = sparse.to_dict()
        return torch.cat([values[name] for name in self.sparse_feature_names], dim=1).reshape(-1, self.F, self.D)


class BlockDCNInteraction(InteractionDCNArch):
    """TorchRec's ``InteractionDCNArch`` whose compressed cross net reads the dense features
    and the pooled embeddings as two column blocks: where
    :meth:`~comera_rec.integration.mlp.TTLowRankCrossNet.forward_blocks` scores the net in
    the fused kernel, the ``(B, (F + 1) D)`` concatenation is never made; elsewhere (another
    cross net, gradients, FX tracing) it is TorchRec's forward. Same parameters and
    state-dict names.

    Args:
        num_sparse_features: F.
        crossnet: the cross net over ``(F + 1) D`` features.

    Example::

        >>> from comera_rec.integration.mlp import TTLowRankCrossNet
        >>> net = TTLowRankCrossNet(12, num_layers=1, low_rank=4, tt_rank=2, min_gain=0.0)
        >>> arch = BlockDCNInteraction(2, net)
        >>> dense, sparse = torch.randn(3, 4), torch.randn(3, 2, 4)
        >>> with torch.no_grad():
        ...     torch.allclose(arch(dense, sparse), InteractionDCNArch(2, net)(dense, sparse))
        True
    """

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """``(B, D)`` and ``(B, F, D)`` -> ``(B, (F + 1) D)``."""
        crossnet = self.crossnet
        if (
            self.F > 0
            and hasattr(crossnet, "forward_blocks")  # TTLowRankCrossNet, or its inference form
            and not isinstance(dense_features, torch.fx.Proxy)
            and not isinstance(sparse_features, torch.fx.Proxy)
        ):
            batch = dense_features.shape[0]
            return crossnet.forward_blocks([dense_features, sparse_features.reshape(batch, -1)])
        return super().forward(dense_features, sparse_features)
