"""``compress``: swap compressed modules into an existing TorchRec model, and size accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.modules.mlp import MLP

from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.integration.embedding_collection import TTMEmbeddingCollection
from comera_rec.integration.mlp import TTLowRankCrossNet, fuse_layer_chains
from comera_rec.integration.policy import CompressionPolicy, linear_pays
from comera_rec.integration.torchrec_internals import perceptron_linear, perceptrons
from comera_rec.tensor.linear import TTLinear
from comera_rec.tensor.train import TensorTrainModule


@dataclass(frozen=True)
class ModuleReport:
    """What ``compress`` did to one module."""

    name: str
    """Qualified name of the module in the model."""
    kind: str
    """The replacement's class name (or the original's when it was kept)."""
    params_before: int
    """Parameters of the original module."""
    params_after: int
    """Parameters of the replacement."""

    @property
    def ratio(self) -> float:
        return self.params_before / max(1, self.params_after)


@dataclass(frozen=True)
class KeptModule:
    """A module (or a table inside a compressed collection) that ``compress`` left dense."""

    name: str
    """Qualified name (``<collection>.<table>`` for a table)."""
    kind: str
    """Its class name, or ``"table"``."""
    params: int
    """Its parameters."""
    reason: str
    """Why it was not compressed, and what to do if it should be."""


@dataclass
class CompressionReport:
    """Per-module report of :func:`compress`."""

    modules: list[ModuleReport] = field(default_factory=list)
    """One entry per replaced module, in model order."""
    kept: list[KeptModule] = field(default_factory=list)
    """Every embedding module, table, linear layer or cross net left dense, with the reason."""

    @property
    def params_before(self) -> int:
        return sum(m.params_before for m in self.modules)

    @property
    def params_after(self) -> int:
        return sum(m.params_after for m in self.modules)

    @property
    def ratio(self) -> float:
        return self.params_before / max(1, self.params_after)

    def __str__(self) -> str:
        lines = [f"{'module':48s} {'kind':28s} {'before':>12s} {'after':>12s} {'ratio':>8s}"]
        for m in self.modules:
            lines.append(f"{m.name:48s} {m.kind:28s} {m.params_before:12d} {m.params_after:12d} {m.ratio:8.2f}")
        lines.append(f"{'total':48s} {'':28s} {self.params_before:12d} {self.params_after:12d} {self.ratio:8.2f}")
        if self.kept:
            lines.append("left dense:")
            lines.extend(f"  {k.name} ({k.kind}, {k.params} parameters): {k.reason}" for k in self.kept)
        return "\n".join(lines)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@torch.no_grad()
def compress(model: nn.Module, policy: CompressionPolicy | None = None) -> CompressionReport:
    """Replace, in place, the TorchRec modules of ``model`` by compressed ones.

    * every ``EmbeddingBagCollection`` becomes a :class:`TTMEmbeddingBagCollection`
      (large tables TTM by TT-SVD of the trained weights, small ones dense as they were);
    * every ``EmbeddingCollection`` (sequence, unpooled embeddings) becomes a
      :class:`TTMEmbeddingCollection` by the same rule;
    * every ``LowRankCrossNet`` becomes a :class:`TTLowRankCrossNet` (if
      ``policy.compress_crossnet``);
    * every ``nn.Linear`` (the MLP layers) becomes a ``TTLinear`` by TT-SVD where it
      pays at ``policy.mlp_rank`` (if ``policy.compress_mlps``); a TorchRec ``MLP`` that
      then holds TT layers trains each run of them as one kernel chain
      (:class:`~comera_rec.integration.mlp.ChainedPerceptrons`; state-dict names kept).

    Args:
        model: the model (not wrapped by DMP/DDP yet).
        policy: what to compress; ``CompressionPolicy()`` when ``None``.

    Returns:
        The per-module report (parameters before / after).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, is itself one of the modules that are
            replaced, or ``policy`` is not a :class:`CompressionPolicy` (a bare rank such as
            ``compress(model, 8)`` names ``CompressionPolicy(rank=8)``).

    Example::

        >>> report = compress(dlrm_model, CompressionPolicy(rank=16))  # doctest: +SKIP
        >>> print(report)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compress: model must be a torch.nn.Module, got {type(model).__name__}")
    if policy is not None and not isinstance(policy, CompressionPolicy):
        hint = (
            f"; for a rank pass CompressionPolicy(rank={policy!r})"
            if isinstance(policy, int) and not isinstance(policy, bool)
            else ""
        )
        raise TypeError(
            f"compress: policy must be a CompressionPolicy or None, got {policy!r} ({type(policy).__name__}){hint}"
        )
    policy = policy or CompressionPolicy()
    report = CompressionReport()
    if isinstance(model, (EmbeddingBagCollection, EmbeddingCollection, LowRankCrossNet, nn.Linear)):
        raise TypeError("compress: pass the model that holds the module (the module is replaced in its parent)")
    # the dense child of a sequence collection compressed before is already the policy's choice
    compressed_ec = [n + "." for n, m in model.named_modules() if isinstance(m, TTMEmbeddingCollection)]
    for name, module in list(model.named_modules()):
        if not name or any(name.startswith(p) for p in compressed_ec):
            continue
        replacement: nn.Module | None = None
        if type(module) is EmbeddingBagCollection:
            replacement = TTMEmbeddingBagCollection.from_embedding_bag_collection(module, policy)
        elif type(module) is EmbeddingCollection:
            replacement = TTMEmbeddingCollection.from_embedding_collection(module, policy)
        elif isinstance(module, LowRankCrossNet) and policy.compress_crossnet:
            replacement = TTLowRankCrossNet.from_crossnet(module, policy.mlp_rank, min_gain=policy.mlp_min_gain)
        elif type(module) is nn.Linear and policy.compress_mlps:
            if linear_pays(
                module.in_features, module.out_features, policy.mlp_rank, policy.mlp_min_gain, module.bias is not None
            ):
                replacement = TTLinear.from_linear(module, policy.mlp_rank)
        try:
            model.get_submodule(name)
        except AttributeError:
            continue  # inside a module replaced earlier
        if replacement is None:
            reason = _left_dense_reason(module, policy)
            if reason is not None and not any(name.startswith(k.name + ".") for k in report.kept):
                report.kept.append(KeptModule(name, type(module).__name__, _numel(module), reason))
            continue
        _set_submodule(model, name, replacement)
        report.modules.append(ModuleReport(name, type(replacement).__name__, _numel(module), _numel(replacement)))
        if isinstance(replacement, (TTMEmbeddingBagCollection, TTMEmbeddingCollection)):
            configs = (
                replacement.embedding_bag_configs()
                if isinstance(replacement, TTMEmbeddingBagCollection)
                else replacement.embedding_configs()
            )
            sizes = {t.name: t.num_embeddings * t.embedding_dim for t in configs}
            for table in replacement.dense_tables():
                report.kept.append(
                    KeptModule(f"{name}.{table}", "table", sizes[table], replacement.plans[table].reason)
                )
    # an MLP with TT layers trains its runs of them as one kernel chain (state dict unchanged)
    for module in model.modules():
        if isinstance(module, MLP) and any(isinstance(perceptron_linear(p), TTLinear) for p in perceptrons(module)):
            fuse_layer_chains(module)
    return report


def _left_dense_reason(module: nn.Module, policy: CompressionPolicy) -> str | None:
    """Why ``compress`` leaves ``module`` as it is (None: not a module it would compress)."""
    kind = type(module).__name__
    if isinstance(module, ShardedModule):
        return "already sharded by DistributedModelParallel: call compress() on the model before wrapping it"
    if isinstance(module, FusedEmbeddingBagCollection):
        return "already fused (FusedEmbeddingBagCollection): call compress() on the EmbeddingBagCollection before fusing it"
    if isinstance(module, EmbeddingCollection):
        return f"a subclass ({kind}) of EmbeddingCollection: only the class itself is converted"
    if isinstance(module, EmbeddingBagCollection):
        return f"a subclass ({kind}) of EmbeddingBagCollection: only the class itself is converted"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "a plain torch embedding: put its table in a TorchRec EmbeddingBagCollection to compress it"
    if isinstance(module, LowRankCrossNet):
        return "policy.compress_crossnet is False"
    if isinstance(module, nn.Linear):
        if type(module) is not nn.Linear:
            return f"a subclass ({kind}) of nn.Linear: only nn.Linear itself is converted"
        if not policy.compress_mlps:
            return "policy.compress_mlps is False"
        return (
            f"{module.in_features}->{module.out_features}: TT at rank {policy.mlp_rank} would not be "
            f"{policy.mlp_min_gain}x smaller (linear_min_gain, else min_gain) with no more multiply-adds"
        )
    return None


@dataclass(frozen=True)
class ModelSize:
    """Stored size of a model and of its dense counterpart."""

    num_parameters: int
    """Parameters stored now (TT cores at their physical ranks)."""
    dense_num_parameters: int
    """Parameters of the same model with every TT module dense."""
    num_bytes: int
    """Bytes of the stored parameters."""
    dense_num_bytes: int
    """Bytes of the dense counterpart (each TT module in its cores' dtype)."""

    @property
    def compression_ratio(self) -> float:
        return self.dense_num_bytes / max(1, self.num_bytes)


def model_size(model: nn.Module) -> ModelSize:
    """Parameters and bytes of ``model`` versus its dense counterpart.

    Example::

        >>> size = model_size(nn.Sequential(TTLinear(512, 512, rank=8)))
        >>> size.compression_ratio > 10
        True
    """
    tt_params: set[int] = set()
    dense_params = dense_bytes = 0
    for _, module in model.named_modules():
        if isinstance(module, TensorTrainModule):
            own = list(module.parameters())
            if any(id(p) in tt_params for p in own):
                continue
            tt_params.update(id(p) for p in own)
            n = module.dense_num_parameters()
            dense_params += n
            dense_bytes += n * own[0].element_size()
    params = nbytes = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        nbytes += p.numel() * p.element_size()
        if id(p) not in tt_params:
            dense_params += p.numel()
            dense_bytes += p.numel() * p.element_size()
    return ModelSize(params, dense_params, nbytes, dense_bytes)
