"""TT versions of TorchRec's dense blocks: ``MLP`` and ``LowRankCrossNet``.

Layers become ``TTLinear`` only where the TT layer at the given rank has at least
``min_gain`` times fewer parameters than the dense one; small layers stay ``nn.Linear``.
The module structure (and so the state-dict names) of TorchRec's ``MLP`` is kept.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
from torch import nn
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.mlp import MLP, Perceptron

from comera_rec.integration.policy import linear_pays
from comera_rec.integration.torchrec_internals import (
    mlp_layers,
    perceptron_activation,
    perceptron_linear,
    perceptrons,
    set_mlp_layers,
    set_perceptron_activation,
    set_perceptron_linear,
)
from comera_rec.tensor import kernels
from comera_rec.tensor.contract import linear_from_chains
from comera_rec.tensor.derived import derived_cache
from comera_rec.tensor.kernels.ttm_cpu import records_grad
from comera_rec.tensor.linear import NarrowLinear, TTLinear
from comera_rec.tensor.train import InitOnMaterialize

Activation = Union[str, Callable[[torch.Tensor], torch.Tensor], nn.Module]


def tt_mlp(
    in_size: int,
    layer_sizes: list[int],
    *,
    rank: int,
    bias: bool = True,
    activation: Activation = "relu",
    min_gain: float = 2.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> MLP:
    """TorchRec's ``MLP`` with ``TTLinear`` layers where they pay.

    Args:
        in_size: input features.
        layer_sizes: output size of each layer.
        rank: TT rank of the compressed layers.
        bias: layers learn a bias.
        activation: as for ``torchrec.modules.mlp.MLP``.
        min_gain: dense / TT parameter ratio a layer needs to be compressed.
        device: where to allocate (``"meta"`` allowed).
        dtype: parameter dtype.

    Returns:
        An ``MLP`` whose ``Perceptron._linear`` is a ``TTLinear`` where it pays; with the
        ReLU activation that layer applies the ReLU itself (fused into its CPU kernel) and
        the perceptron's activation becomes the identity.

    Example::

        >>> mlp = tt_mlp(13, [512, 256, 64, 16], rank=16)
        >>> [type(perceptron_linear(p)).__name__ for p in perceptrons(mlp)]
        ['Linear', 'TTLinear', 'TTLinear', 'Linear']
    """
    mlp = MLP(in_size, layer_sizes, bias=bias, activation=activation, device=device, dtype=dtype)
    for perceptron in perceptrons(mlp):
        linear = perceptron_linear(perceptron)
        if linear_pays(linear.in_features, linear.out_features, rank, min_gain, bias):
            relu = is_relu(perceptron_activation(perceptron))
            layer = TTLinear(
                linear.in_features, linear.out_features, rank, bias=bias, device=device, dtype=dtype, relu=relu
            )
            set_perceptron_linear(perceptron, layer)
            if relu:
                set_perceptron_activation(perceptron, nn.Identity())
    return fuse_layer_chains(mlp)


def fuse_narrow_layers(mlp: MLP) -> MLP:
    """Make the plain ``nn.Linear`` layers of ``mlp`` with at most
    ``NarrowLinear.MAX_FUSED_INPUTS`` inputs :class:`NarrowLinear` (sharing their
    parameters; a ReLU activation is fused in), in place. The values are the same; on CPU
    the layer's forward and backward are one pass each. Returns ``mlp``.

    Example::

        >>> mlp = fuse_narrow_layers(MLP(13, [512, 256]))
        >>> [type(perceptron_linear(p)).__name__ for p in perceptrons(mlp)]
        ['NarrowLinear', 'Linear']
    """
    for perceptron in perceptrons(mlp):
        linear = perceptron_linear(perceptron)
        if type(linear) is nn.Linear and linear.in_features <= NarrowLinear.MAX_FUSED_INPUTS:
            relu = is_relu(perceptron_activation(perceptron))
            set_perceptron_linear(perceptron, NarrowLinear.from_linear(linear, relu=relu))
            if relu:
                set_perceptron_activation(perceptron, nn.Identity())
    return mlp


class ChainedPerceptrons(nn.Sequential):
    """The ``nn.Sequential`` of an ``MLP``'s perceptrons that, while training on CPU, runs
    each run of consecutive fused layers (``TTLinear``, ``NarrowLinear``; their ReLU, or
    the perceptron's, applied in the kernel) as one chain
    (:func:`~comera_rec.tensor.kernels.tt_chain_cpu`): a block of rows goes through every
    layer of the run while it is in cache, and the hidden outputs are not kept for the
    backward but recomputed from each layer's ``(B, r)`` product with its input chain.
    A run ends where its layers' weights and weight-gradient partials would outgrow half of
    a core's L2 (:func:`~comera_rec.tensor.kernels.chain_fits`). The values are the layers'
    one by one, bit for bit; anything else (scoring, a GPU, other layers, the kernels off)
    runs perceptron by perceptron.

    Example::

        >>> mlp = tt_mlp(13, [512, 256], rank=16)
        >>> type(mlp_layers(mlp)).__name__
        'ChainedPerceptrons'
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if type(input) is not torch.Tensor or input.dim() != 2 or not torch.is_grad_enabled():
            return super().forward(input)
        input = kernels.float32_under_cpu_autocast(input)  # the kernels' precision under CPU autocast
        h, run = input, []  # the current run's layers: (left, right, bias, relu)
        run_bytes = 0  # what the run keeps in cache per block of rows (kernels.chain_bytes)

        def finish_run() -> torch.Tensor:
            # the run so far on h: one layer through its own kernel, more as a chain
            out = h
            if len(run) == 1:
                out = kernels.tt_linear_cpu(h, *run[0])
            elif run:
                out = kernels.tt_chain_cpu(h, run)
            run.clear()
            return out

        for perceptron in self:
            operands = _chain_operands(perceptron, h)
            width = run[-1][1].shape[1] if run else h.shape[1]
            if operands is None or operands[0].shape[0] != width:
                h = finish_run()
                h = perceptron(h)
                continue
            layer_bytes = kernels.chain_bytes(operands[0], operands[1])
            if run and not kernels.chain_fits(run_bytes + layer_bytes):
                h = finish_run()  # a new run: weights and partials beyond the cache cost what it saves
                run_bytes = 0
            run.append(operands)
            run_bytes += layer_bytes
        return finish_run()


def _chain_operands(perceptron: nn.Module, like: torch.Tensor) -> tuple | None:
    """A perceptron's layer of a chain: ``(left, right, bias, relu)``, the ReLU its layer's
    or its own; ``None`` where it cannot be one."""
    if not isinstance(perceptron, Perceptron):
        return None
    chain_operands = getattr(perceptron_linear(perceptron), "chain_operands", None)
    if chain_operands is None:
        return None
    activation = perceptron_activation(perceptron)
    relu_after = is_relu(activation)
    if not relu_after and type(activation) is not nn.Identity:
        return None
    operands = chain_operands(like)
    if operands is None:
        return None
    left, right, bias, relu = operands
    return left, right, bias, relu or relu_after


def fuse_layer_chains(mlp: MLP) -> MLP:
    """Make ``mlp``'s perceptrons a :class:`ChainedPerceptrons` (the same modules; state-dict
    names unchanged), in place. Returns ``mlp``.

    Example::

        >>> mlp = fuse_layer_chains(MLP(13, [8, 4]))
        >>> type(mlp_layers(mlp)).__name__
        'ChainedPerceptrons'
    """
    if type(mlp_layers(mlp)) is not ChainedPerceptrons:
        set_mlp_layers(mlp, ChainedPerceptrons(*perceptrons(mlp)))
    return mlp


def unchain_layers(mlp: MLP) -> MLP:
    """Undo :func:`fuse_layer_chains`: ``mlp``'s perceptrons (the same modules) in TorchRec's
    plain ``nn.Sequential`` again, each layer one kernel call (the benchmark's
    ``tt_unchained``), in place. Returns ``mlp``.

    Example::

        >>> mlp = unchain_layers(tt_mlp(13, [512, 256], rank=16))
        >>> type(mlp_layers(mlp)).__name__
        'Sequential'
    """
    if type(mlp_layers(mlp)) is ChainedPerceptrons:
        set_mlp_layers(mlp, nn.Sequential(*perceptrons(mlp)))
    return mlp


def merge_projections(v: TTLinear, w: TTLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """``w(v(x)) = x @ left @ right`` for bias-free TT layers ``v: N -> L``, ``w: L -> M``.

    Each layer's chains are ``(left, right)`` (:meth:`TTLinear.chains`); the small middle
    product ``right_v @ left_w`` (``r_v x r_w``) is folded into the side of the higher rank,
    so the merged weight keeps the lower one.

    Example::

        >>> v, w = TTLinear(64, 32, rank=4, bias=False), TTLinear(32, 64, rank=4, bias=False)
        >>> left, right = merge_projections(v, w)
        >>> x = torch.randn(3, 64)
        >>> torch.allclose(x @ left @ right, w(v(x)), atol=1e-5)
        True
    """
    left_v, right_v = v.chains()  # (N, r_v), (r_v, L)
    left_w, right_w = w.chains()  # (L, r_w), (r_w, M)
    middle = right_v @ left_w  # (r_v, r_w)
    if left_w.shape[1] <= left_v.shape[1]:
        return (left_v @ middle).contiguous(), right_w.contiguous()
    return left_v.contiguous(), (middle @ right_w).contiguous()


def is_relu(activation: Activation) -> bool:
    """Whether an ``MLP`` activation is the plain ReLU (which a ``TTLinear`` can fuse)."""
    return activation is torch.relu or activation is torch.nn.functional.relu or type(activation) is nn.ReLU


class TTLowRankCrossNet(InitOnMaterialize):
    """``LowRankCrossNet`` whose projections ``V_l: N -> r`` and ``W_l: r -> N`` are
    ``TTLinear`` where they pay: ``x_{l+1} = x_0 * (W_l(V_l(x_l)) + b_l) + x_l``.

    Args:
        in_features: N, the input size.
        num_layers: number of cross layers.
        low_rank: r, the inner size of each cross layer.
        tt_rank: TT rank of the compressed projections.
        min_gain: dense / TT parameter ratio a projection needs to be compressed.
        device: where to allocate (``"meta"`` allowed: materialised by
            ``DistributedModelParallel`` or ``wrap_model``, it is initialised by
            :meth:`reset_parameters`).
        dtype: parameter dtype.

    Example::

        >>> net = TTLowRankCrossNet(3456, num_layers=3, low_rank=512, tt_rank=16)
        >>> net(torch.randn(2, 3456)).shape
        torch.Size([2, 3456])
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        low_rank: int,
        *,
        tt_rank: int,
        min_gain: float = 2.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if low_rank < 1 or num_layers < 1:
            raise ValueError(f"TTLowRankCrossNet: low_rank and num_layers must be >= 1, got {low_rank}, {num_layers}")
        self.in_features = in_features
        self.low_rank = low_rank

        def projection(n_in: int, n_out: int) -> nn.Module:
            if linear_pays(n_in, n_out, tt_rank, min_gain, bias=False):
                return TTLinear(n_in, n_out, tt_rank, bias=False, device=device, dtype=dtype)
            layer = nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype)
            if not layer.weight.is_meta:
                nn.init.xavier_normal_(layer.weight)
            return layer

        self.V = nn.ModuleList([projection(in_features, low_rank) for _ in range(num_layers)])
        self.W = nn.ModuleList([projection(low_rank, in_features) for _ in range(num_layers)])
        self.bias = nn.ParameterList(
            [nn.Parameter(torch.zeros(in_features, device=device, dtype=dtype)) for _ in range(num_layers)]
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise as a new one: TT projections by their own ``reset_parameters``,
        dense ones Xavier-normal, biases zero (no-op for tensors still on ``meta``)."""
        for layer in (*self.V, *self.W):
            if isinstance(layer, TTLinear):
                layer.reset_parameters()
            elif not layer.weight.is_meta:
                nn.init.xavier_normal_(layer.weight)
        for b in self.bias:
            if not b.is_meta:
                b.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``(B, N) -> (B, N)``.

        Each layer whose two projections are bias-free ``TTLinear`` runs as one merged TT
        weight ``N -> N`` (:func:`merge_projections`): ``4 r N`` multiply-adds a row instead
        of ``4 r (N + low_rank)``. Scoring (no gradient recorded) with every layer so, the
        whole net runs in one call of the fused CPU kernel
        (:func:`~comera_rec.tensor.kernels.tt_cross_cpu`), each ``(B, N)`` activation read
        from memory once, not once per layer and pass; otherwise :meth:`forward_layers`.
        """
        if isinstance(input, torch.fx.Proxy):  # FX tracing (TorchRec's pipelines): no checks on a proxy
            return self.forward_layers(input)
        merged = self._merged_layers([input])
        if merged is not None:
            return kernels.tt_cross_cpu(input, merged)
        return self.forward_layers(input)

    def forward_blocks(self, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        """``self(torch.cat(blocks, dim=1))``, ``blocks`` the input's column blocks ``(B,
        N_p)`` in order. Where the fused kernel scores the net (see :meth:`forward`) it reads
        them as they are, and the ``(B, N)`` input is never made: at MLPerf's shapes that
        concatenation is a 56 MB copy per 4096 rows.

        Example::

            >>> net = TTLowRankCrossNet(12, num_layers=2, low_rank=4, tt_rank=2, min_gain=0.0)
            >>> dense, sparse = torch.randn(3, 4), torch.randn(3, 8)
            >>> with torch.no_grad():
            ...     torch.allclose(net.forward_blocks([dense, sparse]), net(torch.cat([dense, sparse], 1)))
            True
        """
        merged = self._merged_layers(blocks)
        if merged is not None:
            return kernels.tt_cross_cpu(blocks, merged)
        return self(torch.cat(list(blocks), dim=1))

    def forward_layers(self, input: torch.Tensor) -> torch.Tensor:
        """``(B, N) -> (B, N)`` layer by layer (the path with gradients; scoring takes it where
        the fused cross kernel does not apply).

        A layer whose two projections are bias-free ``TTLinear`` runs as their merged TT
        weight (:func:`merge_projections`, differentiable: the gradients reach each layer's
        cores and controllers), one TT product instead of two and no ``low_rank``-wide
        intermediate; under FX tracing each projection is called as it is.
        """
        x0 = input
        x = x0
        tracing = isinstance(input, torch.fx.Proxy)
        for v, w, b in zip(self.V, self.W, self.bias):
            if not tracing and self._merges(v, w, x):
                left, right = merge_projections(v, w)
                y = linear_from_chains(x, left, right)
            else:
                y = w(v(x))
            # x0 * (y + b) + x in two passes over (B, N), not three; scoring adds b in place
            y = y + b if torch.is_grad_enabled() else y.add_(b)
            x = torch.addcmul(x, x0, y)
        return x

    def _merges(self, v: nn.Module, w: nn.Module, x: torch.Tensor) -> bool:
        """Whether ``w(v(x))`` may run as the merged weight of two bias-free TT layers: a
        2-D input of the layers' width, dtype and device (anything else goes to the layers,
        whose checks name what is wrong)."""
        return x.dim() == 2 and x.shape[1] == v.in_features and self._mergeable(v, w, x)

    @staticmethod
    def _mergeable(v: nn.Module, w: nn.Module, x: torch.Tensor) -> bool:
        # two bias-free TT layers without ReLU, of x's dtype and device
        if not (isinstance(v, TTLinear) and isinstance(w, TTLinear)):
            return False
        if v.bias is not None or w.bias is not None or v.relu or w.relu:
            return False
        core = next(iter(v.cores._parameters.values()))  # not cores[0]: ParameterList indexing is slow
        return x.dtype == core.dtype and x.device == core.device

    def _merged_layers(
        self, blocks: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """``(left (N, r), right (r, N), bias)`` per layer, ``W_i(V_i(x)) = x @ left @ right``,
        where the fused cross kernel can score the net on the input made of these column
        blocks: no gradient recorded, every projection a ``TTLinear`` without bias or ReLU,
        2-D blocks of one batch, together the net's width, that the kernel takes. The
        merged weights are kept between forwards inside
        :func:`~comera_rec.tensor.cached_weights`."""
        if not blocks or records_grad(*blocks, *self.bias) or torch.compiler.is_compiling():
            return None  # (the cross kernel is no operator a compiled graph can call)
        x = blocks[0]
        if any(b.dim() != 2 or b.shape[0] != x.shape[0] or b.dtype != x.dtype for b in blocks):
            return None
        if sum(b.shape[1] for b in blocks) != self.in_features:
            return None
        layers = []
        for i, (v, w, b) in enumerate(zip(self.V, self.W, self.bias)):
            if not self._mergeable(v, w, x):
                return None
            sources = [*v.train_tensors(), *w.train_tensors()]
            kept = derived_cache(self, f"cross_{i}").get_when(  # scoring: merged once and kept
                sources,
                lambda v=v, w=w: merge_projections(v, w),
                lambda s=sources: not records_grad(*s) and kernels.tt_chains_kernel_applies(s, ()),
            )
            if kept is None:
                return None
            left, right = kept
            if not kernels.tt_linear_kernel_applies(x, left, right):
                return None
            layers.append((left, right, b))
        return layers

    @classmethod
    def from_crossnet(cls, net: LowRankCrossNet, tt_rank: int, *, min_gain: float = 2.0) -> "TTLowRankCrossNet":
        """Convert a trained ``LowRankCrossNet`` (TT-SVD of the projections that pay)."""
        w0 = net.W_kernels[0]
        in_features, low_rank = w0.shape
        out = cls(
            in_features, len(net.W_kernels), low_rank, tt_rank=tt_rank, min_gain=min_gain, device="meta", dtype=w0.dtype
        )

        def convert(weight: torch.Tensor, current: nn.Module) -> nn.Module:
            # weight: (out, in) as nn.Linear stores it
            dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                dense.weight.copy_(weight)
            return TTLinear.from_linear(dense, tt_rank) if isinstance(current, TTLinear) else dense

        for layer in range(len(net.W_kernels)):
            out.V[layer] = convert(net.V_kernels[layer].detach(), out.V[layer])
            out.W[layer] = convert(net.W_kernels[layer].detach(), out.W[layer])
            out.bias[layer] = nn.Parameter(net.bias[layer].detach().clone())
        return out
