"""comera-rec: rank-adaptive tensor-compressed training for TorchRec models.

The tensor core (``comera_rec.tensor``) is importable without TorchRec; the TorchRec
integration is loaded on first use of its names.
"""

from comera_rec.tensor import (
    TensorTrainModule,
    TTLinear,
    TTMEmbeddingBag,
    cached_weights,
    factorize,
    parameter_groups,
    tensor_train_modules,
    tt_svd,
)

__version__ = "0.1.0"

# Names of the TorchRec integration, imported on first access so that
# ``import comera_rec`` does not import TorchRec.
_INTEGRATION = (
    "CompressionPolicy",
    "RankAdapter",
    "TTMEmbeddingBagCollection",
    "TTMEmbeddingCollection",
    "TableOverride",
    "compress",
    "decompress",
    "model_size",
    "rewrap_data_parallel",
    "wrap_model",
)


def __getattr__(name: str):
    if name in _INTEGRATION:
        import comera_rec.integration as integration

        return getattr(integration, name)
    raise AttributeError(f"module 'comera_rec' has no attribute {name!r}")


__all__ = [
    *_INTEGRATION,
    "TTLinear",
    "TTMEmbeddingBag",
    "TensorTrainModule",
    "cached_weights",
    "factorize",
    "parameter_groups",
    "tensor_train_modules",
    "tt_svd",
]
