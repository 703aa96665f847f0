"""DLRM on TorchRec, dense or tensor-compressed: configuration and model assembly.

The package is ``comera_rec.dlrm``: the folder ``dlrm/`` at the top of a checkout, linked
as ``comera_rec/dlrm`` (a copy in the wheel). It is never a top-level ``dlrm``, which is
left to a user's own module of that name.
"""

if __name__ != "comera_rec.dlrm":  # e.g. `import dlrm` from the root of a checkout
    raise ImportError(f"the DLRM assembly is comera_rec.dlrm, not {__name__}: import comera_rec.dlrm")

from comera_rec.dlrm.config import KAGGLE_TABLE_SIZES, MLPERF_TABLE_SIZES, DLRMConfig
from comera_rec.dlrm.interaction import PairwiseDotInteraction
from comera_rec.dlrm.model import build_dlrm, build_dlrm_train, check_dlrm_tables, criteo_tables, dlrm_size, make_dlrm

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
