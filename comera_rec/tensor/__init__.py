"""The tensor core: shapes, tensor-train cores with rank controllers, contractions,
truncation and TT-SVD. Pure PyTorch; it never imports TorchRec or the trainer."""

from comera_rec.tensor.bags import pool_bags
from comera_rec.tensor.contract import (
    merge_input_chain,
    merge_output_chain,
    tt_linear,
    ttm_dense_table,
    ttm_embedding_bag,
    ttm_embedding_bag_static,
    ttm_rows,
)
from comera_rec.tensor.derived import cached_weights
from comera_rec.tensor.embedding import TTMEmbeddingBag, set_static_shapes, ttm_shape
from comera_rec.tensor.linear import NarrowLinear, TTLinear
from comera_rec.tensor.shapes import factorize, tt_linear_shapes, ttm_row_shape
from comera_rec.tensor.svd import tt_svd
from comera_rec.tensor.train import TensorTrainModule, parameter_groups, tensor_train_modules
from comera_rec.tensor.validation import check_bags

__all__ = [
    "NarrowLinear",
    "TTLinear",
    "TTMEmbeddingBag",
    "TensorTrainModule",
    "cached_weights",
    "check_bags",
    "factorize",
    "merge_input_chain",
    "merge_output_chain",
    "parameter_groups",
    "pool_bags",
    "set_static_shapes",
    "tensor_train_modules",
    "tt_linear",
    "tt_linear_shapes",
    "tt_svd",
    "ttm_dense_table",
    "ttm_embedding_bag",
    "ttm_embedding_bag_static",
    "ttm_row_shape",
    "ttm_rows",
    "ttm_shape",
]
