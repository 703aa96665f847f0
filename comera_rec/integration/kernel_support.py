"""Whether FBGEMM can run a model's dense tables on its device, asked before training starts.

:func:`~comera_rec.integration.distributed.wrap_model` hands a model's uncompressed
``EmbeddingBagCollection`` tables to FBGEMM's table-batched kernels (fused into
``FusedEmbeddingBagCollection`` in one process, sharded by DMP in many). The ``fbgemm-gpu-cpu``
package registers those kernels for CPU only, so on a CUDA device with it installed the model
builds and moves to the GPU, and the first training step then fails inside FBGEMM with
``Could not run 'fbgemm::get_infos_metadata' with arguments from the 'CUDA' backend`` (seen on
an H200, docs/gpu.md, "Fifth run"). :func:`check_dense_table_kernels` says so at set-up
instead, naming the tables and the two ways out.
"""

from __future__ import annotations

import fbgemm_gpu
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig  # noqa: F401  (the example)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

# An operator of FBGEMM's table-batched training path that the CPU package registers for CPU only.
_TBE_PROBE_OPERATOR = "fbgemm::get_infos_metadata"


def fbgemm_has_cuda_kernels() -> bool:
    """Whether the installed fbgemm-gpu has its CUDA kernels (the CUDA build, not ``fbgemm-gpu-cpu``).

    Example::

        >>> on_gpu = fbgemm_has_cuda_kernels()  # False with fbgemm-gpu-cpu installed
    """
    if getattr(fbgemm_gpu, "__variant__", None) == "cpu":
        return False
    # torch has no public question for this; a torch without the private one is answered
    # "maybe", which blocks nothing (FBGEMM then names its missing kernel at the first step)
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if has_kernel is None:
        return True
    try:
        cpu_only = has_kernel(_TBE_PROBE_OPERATOR, "CPU") and not has_kernel(_TBE_PROBE_OPERATOR, "CUDA")
    except RuntimeError:  # an operator this fbgemm-gpu does not define says nothing either way
        return True
    return not cpu_only


def dense_collections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the model's plain TorchRec collections, ``EmbeddingBagCollection``
    and ``EmbeddingCollection`` (a compressed collection's ``dense`` child among them): the
    tables TorchRec shards, or FBGEMM runs, in module order.

    Example::

        >>> ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=9, feature_names=["f"])])
        >>> [name for name, _ in dense_collections(nn.ModuleDict({"ec": ec}))]
        ['ec']
    """
    return [(name, m) for name, m in model.named_modules() if type(m) in (EmbeddingBagCollection, EmbeddingCollection)]


def collection_configs(collection: nn.Module) -> list:
    """The table configs of a TorchRec bag or sequence collection."""
    if isinstance(collection, EmbeddingBagCollection):
        return list(collection.embedding_bag_configs())
    return list(collection.embedding_configs())


def dense_table_names(model: nn.Module) -> list[str]:
    """The tables of the model's plain TorchRec collections (:func:`dense_collections`), in
    module order."""
    return [config.name for _, module in dense_collections(model) for config in collection_configs(module)]


def check_dense_table_kernels(model: nn.Module, device: torch.device | str) -> None:
    """Raise a ``RuntimeError`` when the model has dense tables for FBGEMM on a CUDA device and
    the installed fbgemm-gpu has no CUDA kernels; nothing on CPU, or when every table is
    compressed (TTM tables need no FBGEMM kernel).

    Args:
        model: the model about to be wrapped (on any device, the meta device too).
        device: the device it will train on.

    Example::

        >>> check_dense_table_kernels(model, "cpu")  # never raises on CPU  # doctest: +SKIP
    """
    if torch.device(device).type != "cuda" or fbgemm_has_cuda_kernels():
        return
    names = dense_table_names(model)
    if not names:
        return
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    raise RuntimeError(
        f"{len(names)} table(s) left uncompressed ({shown}) would run in FBGEMM's table-batched "
        f"kernels on {device}, but the installed fbgemm-gpu has no CUDA kernels (fbgemm-gpu-cpu "
        f"{getattr(fbgemm_gpu, '__version__', '?')}). Install the CUDA fbgemm-gpu (docs/install.md), or "
        "compress every table: a compression policy with min_rows_to_compress=0, "
        "min_params_to_compress=0 and min_gain=0 (in a DLRM config: model.min_rows_to_compress=0 "
        "model.min_params_to_compress=0 model.min_gain=0)."
    )
