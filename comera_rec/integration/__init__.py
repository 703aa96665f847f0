"""TorchRec integration: TTM embedding-bag collections, TT MLPs and cross nets,
``compress`` for existing models, and the DistributedModelParallel glue."""

from comera_rec.integration.adapter import RankAdapter
from comera_rec.integration.collection import TTMEmbeddingBagCollection
from comera_rec.integration.compress import (
    CompressionReport,
    KeptModule,
    ModelSize,
    ModuleReport,
    compress,
    model_size,
)
from comera_rec.integration.decompress import DecompressionReport, decompress
from comera_rec.integration.distributed import (
    EmbeddingOptimizerSpec,
    destroy_distributed,
    materialize_tensor_trains,
    replicated_parameter_groups,
    rewrap_data_parallel,
    wrap_model,
)
from comera_rec.integration.embedding_collection import TTMEmbeddingCollection
from comera_rec.integration.mlp import TTLowRankCrossNet, fuse_narrow_layers, tt_mlp
from comera_rec.integration.policy import (
    CompressionPolicy,
    TableOverride,
    TablePlan,
    linear_pays,
    plan_table,
    plan_tables,
)

__all__ = [
    "CompressionPolicy",
    "CompressionReport",
    "DecompressionReport",
    "EmbeddingOptimizerSpec",
    "KeptModule",
    "ModelSize",
    "ModuleReport",
    "RankAdapter",
    "TTLowRankCrossNet",
    "TTMEmbeddingBagCollection",
    "TTMEmbeddingCollection",
    "TableOverride",
    "TablePlan",
    "compress",
    "decompress",
    "destroy_distributed",
    "linear_pays",
    "materialize_tensor_trains",
    "model_size",
    "plan_table",
    "plan_tables",
    "replicated_parameter_groups",
    "rewrap_data_parallel",
    "fuse_narrow_layers",
    "tt_mlp",
    "wrap_model",
]
