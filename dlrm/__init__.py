"""DLRM on TorchRec, dense or tensor-compressed: configuration and model assembly."""

from dlrm.config import KAGGLE_TABLE_SIZES, MLPERF_TABLE_SIZES, DLRMConfig
from dlrm.interaction import PairwiseDotInteraction
from dlrm.model import build_dlrm, build_dlrm_train, check_dlrm_tables, criteo_tables, dlrm_size, make_dlrm

__all__ = [
    "DLRMConfig",
    "KAGGLE_TABLE_SIZES",
    "MLPERF_TABLE_SIZES",
    "PairwiseDotInteraction",
    "build_dlrm",
    "build_dlrm_train",
    "check_dlrm_tables",
    "criteo_tables",
    "dlrm_size",
    "make_dlrm",
]
