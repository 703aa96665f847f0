"""The dense parts of a DLRM's inference form (:mod:`comera_rec.dlrm.export`): linear and
TT layers with their chains merged, a TT cross net with each layer's projections merged into
one weight, the pairwise-dot interaction without its kernel, :func:`serving_dense_part`,
which swaps them into a copy of a dense arch, and :func:`fuse_cross_net_and_top_mlp`,
which hands a DCN top MLP's TT layers to the cross net's kernel."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import InteractionDCNArch, OverArch
from torchrec.modules.mlp import MLP, Perceptron

from comera_rec.dlrm.interaction import PairwiseDotInteraction
from comera_rec.integration.mlp import TTLowRankCrossNet, merge_projections
from comera_rec.tensor.contract import merge_input_chain, merge_output_chain
from comera_rec.tensor.kernels.tt_linear_cpu import CROSS_BLOCK_ROWS
from comera_rec.tensor.linear import NarrowLinear, TTLinear
from comera_rec.tensor.train import TensorTrainModule


class ExportError(RuntimeError):
    """A part of the model has no inference form or does not export; the message names it."""

    __module__ = "comera_rec.dlrm.export"  # its public home (re-exported there): exported programs and pickles name it


class ServingLinear(nn.Module):
    """``relu?(x @ W^T + b)``: the inference form of ``nn.Linear`` / ``NarrowLinear``.

    Args:
        linear: the layer to copy (weights detached).
        relu: apply a ReLU (a ``NarrowLinear`` with its ReLU fused in).
    """

    __module__ = "comera_rec.dlrm.export"  # its public home (re-exported there): exported programs and pickles name it

    def __init__(self, linear: nn.Linear, relu: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False) if linear.bias is not None else None
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu and self.bias is not None and x.dim() == 2:
            return torch._addmm_activation(self.bias, x, self.weight.t())  # the ReLU on the product in place
        y = F.linear(x, self.weight, self.bias)
        return torch.relu(y) if self.relu else y


class ServingTTLinear(nn.Module):
    """A ``TTLinear`` with its chains merged: ``relu?((x @ left) @ right + bias)``.

    Args:
        layer: the TT layer (controllers are folded into its cores first).
        kernels: one ``torch.ops.comera_rec.tt_linear`` call (the fused CPU kernel:
            :mod:`comera_rec.dlrm.serving_ops`) instead of two matrix products.
    """

    __module__ = "comera_rec.dlrm.export"  # its public home (re-exported there): exported programs and pickles name it

    def __init__(self, layer: TTLinear, kernels: bool = False) -> None:
        super().__init__()
        self.kernels = kernels
        with torch.no_grad():
            inputs, outputs = layer._split()
            left = merge_input_chain(inputs)[: layer.in_features]  # (in, r)
            right = merge_output_chain(outputs)[:, : layer.out_features]  # (r, out)
        # clones: a slice keeps its whole storage, which the saved program would hold too
        self.left = nn.Parameter(left.detach().clone(), requires_grad=False)
        self.right = nn.Parameter(right.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False) if layer.bias is not None else None
        self.relu = layer.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a DLRM's layers see (B, in) rows: no reshapes in the graph (each node costs
        # microseconds of a one-row batch's time); other leading dims are flattened
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.kernels:
            y = torch.ops.comera_rec.tt_linear(rows, self.left, self.right, self.bias, self.relu)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
        t = rows @ self.left  # (B, r)
        if self.bias is not None and self.relu:
            # one ATen op: the ReLU applied in place to the product's output (a ReLU of its
            # own reads and writes a fresh (B, out) tensor: 4096 x 256 rows, 2.4 -> 1.4 ms)
            y = torch._addmm_activation(self.bias, t, self.right)
        else:
            y = t @ self.right if self.bias is None else torch.addmm(self.bias, t, self.right)
            if self.relu:
                y = torch.relu(y)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class ServingPairwiseDot(nn.Module):
    """``PairwiseDotInteraction``: ``[dense, dots of pairs i < j]``, by default without its
    kernel (a batched GEMM and a gather).

    Args:
        num_sparse_features: F.
        kernels: one ``torch.ops.comera_rec.pairwise_dots`` call (the fused CPU kernel:
            :mod:`comera_rec.dlrm.serving_ops`).
    """

    __module__ = "comera_rec.dlrm.export"  # its public home (re-exported there): exported programs and pickles name it

    def __init__(self, num_sparse_features: int, kernels: bool = False) -> None:
        super().__init__()
        self.kernels = kernels
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("upper", rows * n + cols)  # flat (i, j), i < j, in output order
        self.n = n

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return torch.ops.comera_rec.pairwise_dots(dense_features, sparse_features)
        combined = torch.cat([dense_features.unsqueeze(1), sparse_features], dim=1)  # (B, n, D)
        grid = torch.bmm(combined, combined.transpose(1, 2))  # (B, n, n)
        pairs = grid.reshape(-1, self.n * self.n).index_select(1, self.upper)
        return torch.cat([dense_features, pairs], dim=1)


class ServingCrossNet(nn.Module):
    """A ``TTLowRankCrossNet`` whose projections are all ``TTLinear``, each layer's two
    merged into one TT weight (:func:`~comera_rec.integration.mlp.merge_projections`):
    ``x_{k+1} = x_k + x0 * ((x_k @ left_k) @ right_k + bias_k)``, ``4 r N`` multiply-adds a
    row per layer instead of ``4 r (N + low_rank)``.

    Args:
        net: the cross net (weights detached).
        kernels: the whole net one ``torch.ops.comera_rec.tt_cross`` call (the fused CPU
            kernel: :mod:`comera_rec.dlrm.serving_ops`), its input's column blocks read
            where they are (:meth:`forward_blocks`).

    Attributes:
        next_layers: TT layers applied to the net's output one after the other (none by
            default). With ``kernels``, net and layers are one
            ``torch.ops.comera_rec.tt_cross_mlp`` call, which writes neither the net's
            ``(B, N)`` output nor the layers' own but the last to memory
            (:func:`fuse_cross_net_and_top_mlp` sets them).
    """

    __module__ = "comera_rec.dlrm.export"  # its public home (re-exported there): exported programs and pickles name it

    def __init__(self, net: TTLowRankCrossNet, kernels: bool = False) -> None:
        super().__init__()
        self.kernels = kernels
        self.block_rows = CROSS_BLOCK_ROWS
        with torch.no_grad():
            merged = [merge_projections(v, w) for v, w in zip(net.V, net.W)]
        self.lefts = nn.ParameterList([nn.Parameter(left.detach().clone(), requires_grad=False) for left, _ in merged])
        self.rights = nn.ParameterList([nn.Parameter(r.detach().clone(), requires_grad=False) for _, r in merged])
        self.biases = nn.ParameterList([nn.Parameter(b.detach().clone(), requires_grad=False) for b in net.bias])
        self.next_layers = nn.ModuleList()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return self.forward_blocks([input])
        x0 = input
        x = x0
        for left, right, bias in zip(self.lefts, self.rights, self.biases):
            x = torch.addcmul(x, x0, torch.addmm(bias, x @ left, right))
        for layer in self.next_layers:
            x = layer(x)
        return x

    def forward_blocks(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """``self(torch.cat(blocks, dim=1))``; with ``kernels`` the blocks are not joined."""
        if not self.kernels:
            return self(torch.cat(blocks, dim=1))
        lefts, rights, biases = list(self.lefts), list(self.rights), list(self.biases)
        if len(self.next_layers) == 0:
            return torch.ops.comera_rec.tt_cross(blocks, lefts, rights, biases, self.block_rows)
        after: list[ServingTTLinear] = list(self.next_layers)
        return torch.ops.comera_rec.tt_cross_mlp(
            blocks,
            lefts,
            rights,
            biases,
            self.block_rows,
            [layer.left for layer in after],
            [layer.right for layer in after],
            [layer.bias if layer.bias is not None else layer.right.new_empty(0) for layer in after],
            [layer.relu for layer in after],
        )


def _all_tt_projections(net: TTLowRankCrossNet) -> bool:
    """Whether every projection of ``net`` is a ``TTLinear`` without bias or ReLU."""
    return all(isinstance(p, TTLinear) and p.bias is None and not p.relu for p in (*net.V, *net.W))


def serving_dense_part(module: nn.Module, where: str, kernels: bool = False) -> nn.Module:
    """A copy of ``module`` with every compressed or fused layer in its inference form.

    Args:
        module: a dense arch, interaction or over arch of a DLRM.
        where: its path in the model, for error messages.
        kernels: TT layers, TT cross nets and the pairwise-dot interaction as
            ``torch.ops.comera_rec`` calls (:mod:`comera_rec.dlrm.serving_ops`; the caller
            loads the operators).

    Raises:
        ExportError: a TT module other than ``TTLinear`` (named by its path) is inside.
    """
    if isinstance(module, TTLinear):
        return ServingTTLinear(module, kernels)
    if isinstance(module, TTLowRankCrossNet) and _all_tt_projections(module):
        return ServingCrossNet(module, kernels)
    if isinstance(module, NarrowLinear):
        return ServingLinear(module, relu=module.relu)
    if isinstance(module, PairwiseDotInteraction):
        return ServingPairwiseDot(module.num_sparse_features, kernels)
    if isinstance(module, TensorTrainModule):
        raise ExportError(f"{where} ({type(module).__name__}): no inference form for this tensor-train module")
    out = copy.copy(module)  # shallow: children are replaced below, parameters shared (not written)
    out._modules = type(module._modules)()
    for name, child in module._modules.items():
        out._modules[name] = None if child is None else serving_dense_part(child, f"{where}.{name}", kernels)
    return out


def _perceptrons(over_arch: nn.Module) -> list[nn.Module]:
    """The layers of the MLP that ``over_arch`` applies to its input first, found through
    TorchRec's ``OverArch``, ``MLP`` and ``nn.Sequential``; empty where it begins otherwise."""
    module = over_arch
    while True:
        if isinstance(module, OverArch):
            module = module.model
        elif isinstance(module, MLP):
            module = module._mlp
        elif isinstance(module, nn.Sequential) and len(module) > 0 and not isinstance(module[0], Perceptron):
            module = module[0]
        else:
            return list(module) if isinstance(module, nn.Sequential) else []


def fuse_cross_net_and_top_mlp(inter_arch: nn.Module, over_arch: nn.Module) -> int:
    """Move the leading TT layers of a DCN's top MLP into its cross net's kernel call.

    Where ``inter_arch`` is a DCN interaction whose cross net is a :class:`ServingCrossNet`
    with kernels and ``over_arch``'s MLP begins with perceptrons whose layer is a
    :class:`ServingTTLinear` with kernels (no activation of their own: a TT layer applies
    its ReLU itself), those layers become the cross net's ``next_layers`` and
    ``nn.Identity`` takes their place in ``over_arch``: ``over_arch(inter_arch(...))``
    computes the same, and neither the cross net's ``(B, N)`` output (MLPerf's 3456
    columns) nor those layers' outputs are written to memory and read back. Both modules
    are changed in place (serving copies, see :func:`serving_dense_part`).

    Args:
        inter_arch: the interaction of a serving DLRM.
        over_arch: its over arch.

    Returns:
        How many layers moved (0, and nothing changed, for any other model).

    Example::

        >>> from comera_rec.dlrm.config import DLRMConfig
        >>> from comera_rec.dlrm.model import build_dlrm
        >>> cfg = DLRMConfig(table_sizes=[100, 50], embedding_dim=8, bottom_mlp=[16, 8],
        ...                  top_mlp=[16, 1], rank=4, min_params_to_compress=0)
        >>> model = build_dlrm(cfg)  # a dot interaction: nothing to fuse
        >>> fuse_cross_net_and_top_mlp(model.inter_arch, model.over_arch)
        0
    """
    crossnet = getattr(inter_arch, "crossnet", None)
    if not (isinstance(inter_arch, InteractionDCNArch) and isinstance(crossnet, ServingCrossNet) and crossnet.kernels):
        return 0
    if len(crossnet.next_layers) > 0:
        return 0
    moved = 0
    for perceptron in _perceptrons(over_arch):
        layer = getattr(perceptron, "_linear", None)
        if not (
            isinstance(perceptron, Perceptron)
            and isinstance(perceptron._activation_fn, nn.Identity)
            and isinstance(layer, ServingTTLinear)
            and layer.kernels
        ):
            break
        crossnet.next_layers.append(layer)
        perceptron._linear = nn.Identity()
        moved += 1
    return moved
