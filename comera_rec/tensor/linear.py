"""TTLinear: a linear layer whose weight is a tensor train with rank controllers."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from comera_rec.tensor import kernels
from comera_rec.tensor.contract import linear_from_chains, merge_input_chain, merge_output_chain, tt_linear
from comera_rec.tensor.derived import cache_applies, derived_cache, scoring_cache_on
from comera_rec.tensor.kernels.ttm_cpu import records_grad
from comera_rec.tensor.shapes import check_shape, tt_linear_shapes
from comera_rec.tensor.svd import tt_svd
from comera_rec.tensor.train import TensorTrainModule, cap_ranks, check_float_dtype, check_rank
from comera_rec.tensor.validation import check_rank_argument


def _fx_leaf_call(module: nn.Module, x: object) -> torch.Tensor:
    """``module(x)``; FX symbolic tracing records it as one call, as it would a leaf.

    TorchRec's train pipelines FX-trace the whole model when none of it is sharded (every
    table compressed); the layers' forwards send a proxy here instead of into their
    checks and kernels (``torch.fx.wrap``).
    """
    return module(x)


torch.fx.wrap("_fx_leaf_call")


class TTLinear(TensorTrainModule):
    """``nn.Linear`` with a tensor-train weight.

    The weight ``W^T`` of shape ``(N_in, N_out)``, ``N_in = n_1...n_d >= in_features``,
    ``N_out = n_{d+1}...n_{2d} >= out_features``, is a train of ``2d`` cores
    ``(r_{k-1}, n_k, r_k)`` with a rank controller on each of the ``2d - 1`` internal
    bonds. The forward merges each side once and applies two skinny GEMMs; the dense
    weight is never formed.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        rank: rank of every internal bond, or one per bond (``2d - 1`` values); capped
            at the largest useful rank.
        bias: add a learnable bias.
        shape: ``(input_factors, output_factors)`` with the same number of factors
            (1 to 4) on each side; chosen by :func:`tt_linear_shapes` when ``None``.
        device: where to allocate (``"meta"`` allocates nothing; call
            :meth:`reset_parameters` later).
        dtype: floating point dtype.
        relu: apply a ReLU to the output, fused into the CPU kernel's pass (the
            activation of an MLP layer; its backward needs no mask of its own).

    Example::

        >>> layer = TTLinear(768, 3072, rank=30)
        >>> layer(torch.randn(4, 768)).shape
        torch.Size([4, 3072])
        >>> layer.shape
        ((8, 8, 12), (12, 16, 16))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int | Sequence[int],
        *,
        bias: bool = True,
        shape: tuple[Sequence[int], Sequence[int]] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        relu: bool = False,
    ) -> None:
        super().__init__()
        dtype = check_float_dtype("TTLinear", dtype)
        rank = check_rank_argument("TTLinear", rank)
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TTLinear: {name} must be a positive integer, got {value!r}")
        if shape is None:
            in_shape, out_shape = tt_linear_shapes(in_features, out_features)
        else:
            in_shape = check_shape("TTLinear input", in_features, shape[0])
            out_shape = check_shape("TTLinear output", out_features, shape[1])
            if len(in_shape) != len(out_shape) or not 1 <= len(in_shape) <= 4:
                raise ValueError(
                    f"TTLinear: input and output shapes need the same number (1-4) of factors, "
                    f"got {list(in_shape)} and {list(out_shape)}"
                )
        self.in_features = in_features
        self.out_features = out_features
        self.relu = bool(relu)
        self.in_shape: tuple[int, ...] = tuple(in_shape)
        self.out_shape: tuple[int, ...] = tuple(out_shape)
        modes = self.in_shape + self.out_shape
        ranks = cap_ranks(check_rank("TTLinear", rank, len(modes) - 1), modes)
        full = [1] + ranks + [1]
        self._init_train(
            core_shapes=[(full[k], modes[k], full[k + 1]) for k in range(len(modes))],
            num_batch_dims=0,
            controller_shapes=[(r,) for r in ranks],
            device=device,
            dtype=dtype,
        )
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    @property
    def shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.in_shape, self.out_shape

    def reset_parameters(self) -> None:
        """Initialise like ``nn.Linear``: weight entries of variance 1 / (3 in_features)."""
        bound = 1.0 / math.sqrt(self.in_features)
        self._init_cores_normal(target_std=bound / math.sqrt(3.0))
        if self.bias is not None and not self.bias.is_meta:
            with torch.no_grad():
                self.bias.uniform_(-bound, bound)

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cores = self.scaled_cores()
        d = len(self.in_shape)
        return cores[:d], cores[d:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features) -> (..., out_features)``.

        Args:
            x: at least 1-D, of the layer's dtype (``layer.double()`` for float64 input)
                and on its device; under ``torch.autocast`` the dtype is autocast's to
                choose (on the CPU the fused kernel takes a bfloat16 / float16 input in
                float32 and returns float32). On the ``meta`` device the output is a meta
                tensor of the right shape.

        Raises:
            ValueError: a 0-d input, or a last dimension other than ``in_features``.
            TypeError: an input of another dtype than the layer's.
            RuntimeError: an input on another device than the layer's.
        """
        if isinstance(x, torch.fx.Proxy):
            return _fx_leaf_call(self, x)
        x = kernels.float32_under_cpu_autocast(x)  # the fused kernel's precision under CPU autocast
        packed = self._kept_packed(x)
        if packed is not None:  # scoring a matrix on the CPU kernel: the call is the kernel's
            return self._score_packed(x, packed)
        self._check_input(x)
        sources = self.train_tensors()
        # the chains merged in one C++ call each way (the controllers scale the running
        # products), not ~50 small autograd operators; scoring (on any device): merged once
        # and kept, so a scoring call is two GEMMs
        kept = derived_cache(self, "chains").get_when(
            sources,
            self._merged_chains,
            lambda: kernels.tt_chains_kernel_applies(sources, ()) or cache_applies(sources),
        )
        if kept is not None:
            packed = self._pack_for_scoring(x, *kept)
            if packed is not None:
                return self._score_packed(x, packed)
            return linear_from_chains(x, *kept, self.bias, relu=self.relu)
        inputs, outputs = self._split()
        return tt_linear(x, inputs, outputs, self.out_features, self.bias, relu=self.relu)

    def chain_operands(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool] | None:
        """``(left, right, bias, relu)``, the chains merged (differentiable), where a forward
        that records gradients on rows like ``like`` runs on the fused CPU kernel: one layer
        of :func:`~comera_rec.tensor.kernels.tt_chain_cpu`. ``None`` where ``forward`` takes
        another path (scoring keeps packed operands of its own; a GPU; the kernels off).

        Args:
            like: of the dtype and device of the layer's input (its shape is not read).
        """
        if type(like) is not torch.Tensor or like.dim() != 2:
            return None
        sources = self.train_tensors()
        if not records_grad(like, *sources, self.bias):
            return None
        # the merged chains' rank is the last input core's right rank: checked before merging,
        # so that a layer the kernel does not take costs no merge here
        rank = sources[len(self.in_shape) - 1].shape[-1]
        if not kernels.tt_linear_rank_applies(like, rank, *sources):
            return None
        left, right = self._merged_chains()
        return left, right, self.bias, self.relu

    # Scoring on the fused CPU kernel keeps the chains and bias packed as the kernel reads
    # them (kernels.tt_linear_pack), keyed on the parameters they come from: at a few rows,
    # packing per call and the checks of the general path took most of a call.
    def _scoring_sources(self) -> list[torch.Tensor]:
        sources = self.train_tensors()
        if self.bias is not None:
            sources.append(self.bias)
        return sources

    def _kept_packed(self, x: object) -> tuple | None:
        """``(packed operands, rank)`` kept for this layer's unchanged parameters, where ``x``
        is a CPU tensor of rows the kernel takes as they were packed for (any leading
        dimensions, as :meth:`_pack_for_scoring` packs for); else ``None`` (the general path
        then checks ``x`` and names what is wrong)."""
        cache = derived_cache(self, "packed")
        if cache.is_empty():  # training, or nothing packed yet: no cost beyond this
            return None
        kept = cache.peek(self._scoring_sources())  # None outside cached_weights / with gradients
        if (
            kept is None
            or type(x) is not torch.Tensor
            or x.dim() == 0
            or not x.is_cpu
            or x.dtype != kept[0][0].dtype
            or x.shape[-1] != self.in_features
            or not kernels.cpu_kernel_enabled()
        ):
            return None
        return kept  # type: ignore[return-value]

    def _score_packed(self, x: torch.Tensor, packed: tuple) -> torch.Tensor:
        # (..., in_features) -> (..., out_features) on the kept (packed operands, rank)
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = kernels.tt_linear_cpu_packed(rows, packed[0], packed[1], self.out_features, self.relu)
        return y if rows is x else y.reshape(*x.shape[:-1], y.shape[-1])

    def _pack_for_scoring(self, x: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> tuple | None:
        """The chains and bias packed for the fused CPU forward and kept, while scoring
        (:func:`~comera_rec.tensor.cached_weights`, no gradients) with a kernel that takes
        ``x``; else ``None``."""
        if not scoring_cache_on():
            return None
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if not kernels.tt_linear_kernel_applies(rows, left, right):
            return None
        bias = self.bias
        return derived_cache(self, "packed").get(
            self._scoring_sources(), lambda: (kernels.tt_linear_pack(left, right, bias), left.shape[1])
        )

    def chains(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight as its two merged chains, ``W^T = left @ right``: ``left
        (in_features, r)`` and ``right (r, out_features)``, the controllers folded in
        (differentiable; kept between forwards inside
        :func:`~comera_rec.tensor.cached_weights`).

        Example::

            >>> layer = TTLinear(16, 8, rank=2, bias=False)
            >>> left, right = layer.chains()
            >>> x = torch.randn(3, 16)
            >>> torch.allclose(x @ left @ right, layer(x), atol=1e-6)
            True
        """
        return derived_cache(self, "chains").get(self.train_tensors(), self._merged_chains)

    def _merged_chains(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(left (in, r), right (r, out))`` by the C++ chain merge, or by torch operators
        where it does not apply (a GPU; kept between forwards without gradients while the
        parameters do not change)."""
        d = len(self.in_shape)
        sources = self.train_tensors()  # the 2d cores, then the 2d - 1 controllers
        if kernels.tt_chains_kernel_applies(sources, ()):
            return kernels.tt_chains_cpu(
                sources[:d], sources[d : 2 * d], sources[2 * d :], self.in_features, self.out_features
            )
        inputs, outputs = self._split()
        return merge_input_chain(inputs)[: self.in_features], merge_output_chain(outputs)[:, : self.out_features]

    def _check_input(self, x: torch.Tensor) -> None:
        """Raise, naming the input's shape, dtype or device, where ``forward`` cannot take ``x``."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"TTLinear: input must be a tensor, got {type(x).__name__}")
        if x.dim() == 0:
            raise ValueError(
                f"TTLinear: input must have at least 1 dimension (..., {self.in_features}), got a 0-d tensor "
                f"of shape {tuple(x.shape)}"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"TTLinear: expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}"
            )
        weight = next(iter(self.cores._parameters.values()))  # not cores[0]: ParameterList indexing is slow
        if x.dtype != weight.dtype and not kernels.autocast_enabled(x.device.type):
            raise TypeError(
                f"TTLinear: input dtype {x.dtype} differs from the layer's dtype {weight.dtype}; convert the "
                f"input (x.to({weight.dtype})) or the layer (layer.to({x.dtype}))"
                if x.dtype.is_floating_point
                else f"TTLinear: input must be floating point (the layer's dtype {weight.dtype}), got {x.dtype}"
            )
        if x.device != weight.device:
            raise RuntimeError(
                f"TTLinear: input on {x.device}, the layer's parameters on {weight.device}; move one to the other"
            )

    def dense_weight(self) -> torch.Tensor:
        """The ``(out_features, in_features)`` weight, differentiable in the cores."""
        inputs, outputs = self._split()
        left = merge_input_chain(inputs)[: self.in_features]  # (in, r)
        right = merge_output_chain(outputs)[:, : self.out_features]  # (r, out)
        return (left @ right).t()

    def _extra_num_parameters(self) -> int:
        return 0 if self.bias is None else self.out_features

    def dense_num_parameters(self) -> int:
        return self.in_features * self.out_features + self._extra_num_parameters()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"shape={self.shape}, ranks={self.ranks}, bias={self.bias is not None}"
            + (", relu=True" if self.relu else "")
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        rank: int | Sequence[int],
        *,
        shape: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> "TTLinear":
        """Convert a dense layer by TT-SVD at ``rank`` (exact at full rank).

        Example::

            >>> dense = nn.Linear(64, 32)
            >>> tt = TTLinear.from_linear(dense, rank=64)
            >>> torch.allclose(tt.dense_weight(), dense.weight, atol=1e-5)
            True
        """
        w = linear.weight.detach()
        layer = cls(
            linear.in_features,
            linear.out_features,
            rank,
            bias=linear.bias is not None,
            shape=shape,
            device="meta",
            dtype=w.dtype,
        )
        n_in, n_out = math.prod(layer.in_shape), math.prod(layer.out_shape)
        padded = F.pad(w.t(), (0, n_out - linear.out_features, 0, n_in - linear.in_features))
        cores = tt_svd(padded.reshape(layer.in_shape + layer.out_shape), layer.ranks)
        layer.cores = nn.ParameterList([nn.Parameter(c.to(w.device)) for c in cores])
        layer.controllers = nn.ParameterList(
            [nn.Parameter(torch.ones(c.shape[-1], device=w.device, dtype=w.dtype)) for c in cores[:-1]]
        )
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone())
        return layer


class NarrowLinear(nn.Linear):
    """``nn.Linear`` (optionally followed by a ReLU) for a layer with few inputs, such as
    DLRM's first bottom layer (13 dense features -> 512).

    On CPU it runs as the fused TT linear kernel with an identity input chain:
    ``relu((x @ I) @ W^T + b)``, forward and backward each one pass over the batch in
    tiles of rows, the bias, the ReLU and its mask applied on the way (BLAS computes the
    narrow weight gradient ``g^T x`` in a slow layout, and the ReLU, its mask and the bias
    gradient each take a pass of their own over the wide output). Elsewhere, or with more
    than :attr:`MAX_FUSED_INPUTS` inputs, it is ``F.linear`` (+ ``relu``). Parameters,
    state-dict names and initialisation are ``nn.Linear``'s.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias.
        relu: apply a ReLU to the output.
        device: where to allocate.
        dtype: parameter dtype.

    Example::

        >>> layer = NarrowLinear(13, 512, relu=True)
        >>> x = torch.randn(4, 13)
        >>> torch.allclose(layer(x), torch.relu(F.linear(x, layer.weight, layer.bias)), atol=1e-6)
        True
    """

    MAX_FUSED_INPUTS = 32  # the identity chain's width: rank vectors the kernel holds in registers

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        relu: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.relu = relu

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, relu: bool = False) -> "NarrowLinear":
        """The same layer, sharing ``linear``'s parameters."""
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, relu=relu, device="meta")
        out.weight = linear.weight
        out.bias = linear.bias
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, in_features) -> (B, out_features)`` (any leading dims on the unfused path)."""
        if isinstance(x, torch.fx.Proxy):
            return _fx_leaf_call(self, x)
        x = kernels.float32_under_cpu_autocast(x)  # the fused kernel's precision under CPU autocast
        if not records_grad(x, self.weight, self.bias):
            # scoring: without a backward the kernel has no layout to win, and BLAS was as
            # fast at every batch (13 -> 512 on the AVX2 host, 1 to 4096 rows), without the
            # kernel's checks and packing (one row: 10 us against 60 us through the module)
            y = F.linear(x, self.weight, self.bias)
            return y.relu_() if self.relu else y
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"NarrowLinear: expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}"
            )
        operands = self.chain_operands(x)
        if operands is not None:
            return kernels.tt_linear_cpu(x, *operands)
        y = F.linear(x, self.weight, self.bias)
        return torch.relu(y) if self.relu else y

    def chain_operands(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool] | None:
        """``(identity, weight^T, bias, relu)`` where a forward that records gradients on
        rows like ``like`` runs on the fused CPU kernel: one layer of
        :func:`~comera_rec.tensor.kernels.tt_chain_cpu`; else ``None``.

        Args:
            like: of the dtype and device of the layer's input (its shape is not read).
        """
        if type(like) is not torch.Tensor or like.dim() != 2 or self.in_features > self.MAX_FUSED_INPUTS:
            return None
        if not records_grad(like, self.weight, self.bias):
            return None
        identity = _identity(self.in_features, self.weight)
        right = self.weight.t()  # (in, out)
        if not kernels.tt_linear_kernel_applies(like, identity, right):
            return None
        return identity, right, self.bias, self.relu

    def extra_repr(self) -> str:
        return super().extra_repr() + (", relu=True" if self.relu else "")


_IDENTITIES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _identity(n: int, like: torch.Tensor) -> torch.Tensor:
    """An ``n x n`` identity of ``like``'s dtype and device, made once."""
    if torch.compiler.is_compiling():  # a constant of the graph (filling the dict would recompile it)
        return torch.eye(n, dtype=like.dtype, device=like.device)
    key = (n, like.dtype, like.device)
    if key not in _IDENTITIES:
        _IDENTITIES[key] = torch.eye(n, dtype=like.dtype, device=like.device)
    return _IDENTITIES[key]
