"""``decompress``: the inverse of ``compress``; every compressed module back to TorchRec's dense one.

A decompressed model holds only stock modules (``EmbeddingBagCollection``,
``EmbeddingCollection``, ``LowRankCrossNet``, ``nn.Linear``, ``nn.EmbeddingBag``), so its ``state_dict`` loads
(``strict=True``) into a TorchRec model of the same config built without comera-rec,
and it serves with any TorchRec inference stack. The weights are the compressed
modules' reconstructions (each TT / TTM train multiplied out once, controllers
included), so the outputs are those of the compressed model up to float rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mlp import Perceptron

from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.integration.compress import ModuleReport
from comera_rec.integration.embedding_collection import TTMEmbeddingCollection
from comera_rec.integration.mlp import TTLowRankCrossNet
from comera_rec.integration.torchrec_internals import (
    perceptron_activation,
    perceptron_linear,
    set_perceptron_activation,
)
from comera_rec.tensor.embedding import TTMEmbeddingBag
from comera_rec.tensor.linear import NarrowLinear, TTLinear

# the modules decompress() replaces (a model that *is* one of them has no parent to replace it in)
_REPLACED = (
    TTMEmbeddingBagCollection,
    TTMEmbeddingCollection,
    TTLowRankCrossNet,
    TTLinear,
    NarrowLinear,
    TTMEmbeddingBag,
)


@dataclass
class DecompressionReport:
    """Per-module report of :func:`decompress`.

    Example::

        >>> report = DecompressionReport([ModuleReport("mlp.0", "Linear", 120, 1056)])
        >>> report.params_before, report.params_after
        (120, 1056)
    """

    modules: list[ModuleReport] = field(default_factory=list)
    """One entry per replaced module, in model order (``params_before``: the compressed
    module's parameters, ``params_after``: the dense replacement's)."""

    @property
    def params_before(self) -> int:
        return sum(m.params_before for m in self.modules)

    @property
    def params_after(self) -> int:
        return sum(m.params_after for m in self.modules)

    @property
    def growth(self) -> float:
        """Dense / compressed parameters of the replaced modules (1.0 when none)."""
        return self.params_after / max(1, self.params_before) if self.modules else 1.0

    def __str__(self) -> str:
        lines = [f"{'module':48s} {'kind':28s} {'before':>12s} {'after':>12s} {'growth':>8s}"]
        for m in self.modules:
            growth = m.params_after / max(1, m.params_before)
            lines.append(f"{m.name:48s} {m.kind:28s} {m.params_before:12d} {m.params_after:12d} {growth:8.2f}")
        lines.append(f"{'total':48s} {'':28s} {self.params_before:12d} {self.params_after:12d} {self.growth:8.2f}")
        return "\n".join(lines)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy: a reconstructed weight is often a transposed view, and a stock
    module loading it (or serving) should see the layout its own parameters have."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` ``(out, in)`` and ``bias``."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
    layer.weight = nn.Parameter(_copy(weight))
    if bias is not None:
        layer.bias = nn.Parameter(_copy(bias))
    return layer


def _linear(module: TTLinear | NarrowLinear, parent: nn.Module, child: str) -> nn.Linear:
    """The dense layer for a TT or narrow layer; a ReLU it had fused goes back where TorchRec has it.

    In a ``Perceptron`` whose activation was made the identity (``tt_mlp`` /
    ``fuse_narrow_layers``) the perceptron gets ``torch.relu`` back, as TorchRec's
    ``MLP(activation="relu")`` builds it; elsewhere the layer stays a ``NarrowLinear``
    with ``relu=True`` (an ``nn.Linear`` with ``nn.Linear``'s state-dict names).
    """
    weight = module.dense_weight() if isinstance(module, TTLinear) else module.weight
    layer = _dense_linear(weight, module.bias)
    if not module.relu:
        return layer
    if (
        isinstance(parent, Perceptron)
        and perceptron_linear(parent) is module
        and isinstance(perceptron_activation(parent), nn.Identity)
    ):
        set_perceptron_activation(parent, torch.relu)
        return layer
    return NarrowLinear.from_linear(layer, relu=True)


def _check_unsharded(module: TTMEmbeddingBagCollection | TTMEmbeddingCollection) -> None:
    if isinstance(module.dense, ShardedModule):
        raise ValueError(
            "decompress: the collection's dense tables are sharded by DistributedModelParallel; "
            "decompress the unwrapped model (e.g. one loaded from a checkpoint)"
        )


def _fill_tables(module: TTMEmbeddingBagCollection | TTMEmbeddingCollection, tables: Mapping[str, nn.Module]) -> None:
    """Copy every table of ``module``, formed whole, into the stock collection's ``tables``."""
    for name, table in tables.items():
        table.weight.detach().copy_(module.table_weight(name).detach().to(table.weight.dtype))


def _embedding_bag_collection(module: TTMEmbeddingBagCollection) -> EmbeddingBagCollection:
    """TorchRec's collection with the same configs and every table formed whole."""
    _check_unsharded(module)
    # copies: the new collection must not share (and so mutate) the compressed one's configs
    configs: list[EmbeddingBagConfig] = [
        dataclasses.replace(t, feature_names=list(t.feature_names)) for t in module.embedding_bag_configs()
    ]
    device = next(module.parameters()).device
    ebc = EmbeddingBagCollection(configs, is_weighted=module.is_weighted(), device=device)
    _fill_tables(module, ebc.embedding_bags)
    return ebc


def _embedding_collection(module: TTMEmbeddingCollection) -> EmbeddingCollection:
    """TorchRec's (unpooled) collection with the same configs and every table formed whole."""
    _check_unsharded(module)
    configs: list[EmbeddingConfig] = [
        dataclasses.replace(t, feature_names=list(t.feature_names)) for t in module.embedding_configs()
    ]
    device = next(module.parameters()).device
    ec = EmbeddingCollection(configs, device=device, need_indices=module.need_indices())
    _fill_tables(module, ec.embeddings)
    return ec


def _crossnet(module: TTLowRankCrossNet) -> LowRankCrossNet:
    """TorchRec's ``LowRankCrossNet`` with the projections' dense weights."""
    num_layers = len(module.V)
    with torch.random.fork_rng(devices=[]):  # its constructor draws a Xavier init we overwrite
        net = LowRankCrossNet(module.in_features, num_layers, module.low_rank)

    def weight(layer: nn.Module) -> torch.Tensor:  # (out, in), the layout of TorchRec's kernels
        w = layer.dense_weight() if isinstance(layer, TTLinear) else layer.weight
        return _copy(w)

    for k in range(num_layers):
        net.V_kernels[k] = nn.Parameter(weight(module.V[k]))  # (low_rank, N)
        net.W_kernels[k] = nn.Parameter(weight(module.W[k]))  # (N, low_rank)
        net.bias[k] = nn.Parameter(_copy(module.bias[k]))
    return net


def _embedding_bag(module: TTMEmbeddingBag) -> nn.EmbeddingBag:
    weight = module.dense_weight().detach()
    bag = nn.EmbeddingBag(
        module.num_embeddings,
        module.embedding_dim,
        mode=module.mode,
        include_last_offset=True,
        device="meta",
        dtype=weight.dtype,
    )
    bag.weight = nn.Parameter(_copy(weight))
    return bag


@torch.no_grad()
def decompress(model: nn.Module) -> DecompressionReport:
    """Replace, in place, every compressed module of ``model`` by TorchRec's dense one.

    * :class:`TTMEmbeddingBagCollection` -> ``EmbeddingBagCollection`` (same configs,
      TTM tables reconstructed, dense tables copied);
    * :class:`TTMEmbeddingCollection` -> ``EmbeddingCollection`` (the same, unpooled, with
      its ``need_indices``);
    * :class:`TTLowRankCrossNet` -> ``LowRankCrossNet``;
    * ``TTLinear`` and ``NarrowLinear`` -> ``nn.Linear`` (a fused ReLU goes back to the
      ``Perceptron``'s activation);
    * ``TTMEmbeddingBag`` -> ``nn.EmbeddingBag(include_last_offset=True)``.

    Truncated ranks need nothing special: the weights are formed from the cores as they
    are. Parameters keep their device and dtype; new ones have ``requires_grad=True``.

    Args:
        model: the model, unwrapped (not under DistributedModelParallel / DDP).

    Returns:
        The per-module report (parameters before / after); empty when nothing was compressed.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or is itself one of the modules that
            are replaced (pass the model that holds it).
        ValueError: a collection's dense tables are sharded (a DMP-wrapped model).

    Example::

        >>> report = compress(dlrm_model, CompressionPolicy(rank=16))  # doctest: +SKIP
        >>> print(decompress(dlrm_model))  # doctest: +SKIP
        >>> stock_dlrm.load_state_dict(dlrm_model.state_dict())  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"decompress: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, _REPLACED):
        raise TypeError(
            f"decompress: model is itself a {type(model).__name__}; pass the model that holds it "
            f"(the module is replaced in its parent)"
        )
    report = DecompressionReport()
    for name, module in list(model.named_modules()):
        if not name or not isinstance(module, _REPLACED):
            continue
        try:
            if model.get_submodule(name) is not module:
                continue
        except AttributeError:
            continue  # inside a module replaced earlier (a TTLinear of a cross net)
        parent, child = _parent(model, name)
        replacement: nn.Module
        if isinstance(module, TTMEmbeddingBagCollection):
            replacement = _embedding_bag_collection(module)
        elif isinstance(module, TTMEmbeddingCollection):
            replacement = _embedding_collection(module)
        elif isinstance(module, TTLowRankCrossNet):
            replacement = _crossnet(module)
        elif isinstance(module, (TTLinear, NarrowLinear)):
            replacement = _linear(module, parent, child)
        else:
            replacement = _embedding_bag(module)
        setattr(parent, child, replacement)
        report.modules.append(ModuleReport(name, type(replacement).__name__, _numel(module), _numel(replacement)))
    return report
