"""Every access comera-rec makes to private fields of TorchRec (and of FBGEMM through it).

TorchRec's public API does not expose a few things the integration needs: the layers of
an ``MLP``, the lookups inside a ``FusedEmbeddingBagCollection``, the module wrapped by
``DistributedModelParallel`` and its data-parallel wrapper, the device an
``EmbeddingBagCollection`` was built on. They are reached here and nowhere else, so that
a TorchRec upgrade that moves them breaks one file, and
:func:`missing_internals` (run by ``tests/integration/test_torchrec_internals.py``) says
which of them moved, by name, on real instances.

Tested with the versions in :data:`TESTED_VERSIONS` (requirements/cpu.txt).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torchrec.modules.mlp import MLP, Perceptron

TESTED_VERSIONS: dict[str, str] = {"torch": "2.13", "torchrec": "1.9.2", "fbgemm_gpu": "1.8.0"}
"""The package versions whose internals this module was written against."""


# ---- MLP / Perceptron -------------------------------------------------------------------


def perceptrons(mlp: MLP) -> list[Perceptron]:
    """The ``Perceptron`` layers of a TorchRec ``MLP``, first to last.

    Example::

        >>> [perceptron_linear(p).out_features for p in perceptrons(MLP(13, [8, 4]))]
        [8, 4]
    """
    return list(mlp._mlp)


def mlp_layers(mlp: MLP) -> nn.Sequential:
    """The ``nn.Sequential`` of an ``MLP``'s perceptrons."""
    return mlp._mlp


def set_mlp_layers(mlp: MLP, layers: nn.Sequential) -> None:
    """Replace the ``nn.Sequential`` of an ``MLP``'s perceptrons (its state-dict name stays
    ``_mlp``)."""
    mlp._mlp = layers


def perceptron_linear(perceptron: Perceptron) -> nn.Module:
    """The linear layer of a ``Perceptron`` (an ``nn.Linear``, or what replaced it)."""
    return perceptron._linear


def set_perceptron_linear(perceptron: Perceptron, layer: nn.Module) -> None:
    """Replace the linear layer of a ``Perceptron`` (its state-dict name stays ``_linear``)."""
    perceptron._linear = layer


def perceptron_activation(perceptron: Perceptron) -> Callable[[torch.Tensor], torch.Tensor] | nn.Module:
    """The activation a ``Perceptron`` applies after its linear layer."""
    return perceptron._activation_fn


def set_perceptron_activation(perceptron: Perceptron, activation: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace the activation of a ``Perceptron`` (a module or a plain function)."""
    if isinstance(perceptron._modules.get("_activation_fn"), nn.Module):
        del perceptron._activation_fn  # a registered submodule: a plain function cannot be assigned over it
    perceptron._activation_fn = activation


# ---- FusedEmbeddingBagCollection --------------------------------------------------------


def fused_lookups(collection: nn.Module) -> list[nn.Module]:
    """The table-batched lookups of an unsharded ``FusedEmbeddingBagCollection``."""
    return list(getattr(collection, "_emb_modules", ()))


def fused_lookup_tables(collection: nn.Module) -> list[list[Any]]:
    """Per lookup of a ``FusedEmbeddingBagCollection``, its table configs in feature order."""
    return [list(tables) for tables in collection._key_to_tables.values()]


def lookup_tbe(lookup: nn.Module) -> Optional[nn.Module]:
    """The FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` inside one TorchRec fused
    lookup, or ``None`` where the lookup has none."""
    return getattr(lookup, "_emb_module", None)


# ---- EmbeddingBagCollection -------------------------------------------------------------


def collection_device(collection: nn.Module) -> Optional[torch.device]:
    """The device a TorchRec embedding collection was built on (``meta`` until
    materialised), or ``None`` for a module without one."""
    return getattr(collection, "_device", None)


def set_collection_device(collection: nn.Module, device: torch.device) -> None:
    """Record the device of a collection whose parameters were materialised outside it."""
    collection._device = device


# ---- DistributedModelParallel -----------------------------------------------------------


def dmp_inner(dmp: nn.Module) -> nn.Module:
    """The module ``DistributedModelParallel`` calls: the sharded model, or the DDP wrapper
    around it when it has replicated parameters."""
    return dmp._dmp_wrapped_module


def rewrap_dmp_data_parallel(dmp: nn.Module) -> None:
    """Build DMP's data-parallel (DDP) wrapper again around the sharded model, in place:
    after replicated parameters changed shape, the old wrapper would no longer average
    their gradients. The sharded tables and their fused optimiser are untouched."""
    from torch.nn.parallel import DistributedDataParallel

    inner = dmp._dmp_wrapped_module
    if isinstance(inner, DistributedDataParallel):
        dmp._dmp_wrapped_module = inner.module
        del inner
    dmp._data_parallel_wrapper.wrap(dmp, dmp._env, dmp.device)


def sharded_tensor_type() -> type:
    """``ShardedTensor``, the type of TorchRec's sharded table state (from a private torch
    package: there is no public import path for it in the tested versions)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return ShardedTensor


# ---- the check --------------------------------------------------------------------------


def missing_internals() -> list[str]:
    """Build small real TorchRec objects and list every internal used above that they lack
    (empty when the installed TorchRec matches). The multi-process parts (DMP's wrapper) are
    checked on the class, since building a DMP needs a process group.

    Example::

        >>> missing_internals()
        []
    """
    from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    missing: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            missing.append(what)

    mlp = MLP(4, [3, 2], device=torch.device("cpu"))
    need(hasattr(mlp, "_mlp"), "torchrec.modules.mlp.MLP._mlp")
    for p in getattr(mlp, "_mlp", [])[:1]:
        need(isinstance(getattr(p, "_linear", None), nn.Linear), "Perceptron._linear (an nn.Linear)")
        need(hasattr(p, "_activation_fn"), "Perceptron._activation_fn")

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    need(getattr(ebc, "_device", None) == torch.device("meta"), "EmbeddingBagCollection._device")

    fused = FusedEmbeddingBagCollection(
        tables, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, device=torch.device("cpu")
    )
    need(len(getattr(fused, "_emb_modules", ())) == 1, "FusedEmbeddingBagCollection._emb_modules")
    need(isinstance(getattr(fused, "_key_to_tables", None), dict), "FusedEmbeddingBagCollection._key_to_tables")
    for lookup in getattr(fused, "_emb_modules", [])[:1]:
        need(hasattr(lookup, "_emb_module"), "fused lookup ._emb_module (the FBGEMM TBE)")

    need(hasattr(DataParallelWrapper, "wrap"), "DataParallelWrapper.wrap")
    init_code = DistributedModelParallel.__init__.__code__.co_names
    for field in ("_dmp_wrapped_module", "_data_parallel_wrapper", "_env"):
        need(field in init_code, f"DistributedModelParallel.{field}")
    try:
        sharded_tensor_type()
    except ImportError:
        missing.append("torch.distributed._shard.sharded_tensor.ShardedTensor")
    return missing
