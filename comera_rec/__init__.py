"""comera-rec: rank-adaptive tensor-compressed training for TorchRec models.

The tensor core (``comera_rec.tensor``) is importable without TorchRec; the TorchRec
integration is loaded on first use of its names.
"""

from comera_rec.tensor import (
    TensorTrainModule,
    TTLinear,
    TTMEmbeddingBag,
    factorize,
    parameter_groups,
    tensor_train_modules,
    tt_svd,
)

__version__ = "0.1.0"

__all__ = [
    "TTLinear",
    "TTMEmbeddingBag",
    "TensorTrainModule",
    "factorize",
    "parameter_groups",
    "tensor_train_modules",
    "tt_svd",
]
