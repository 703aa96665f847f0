"""Rank adaptation (layer 3): the size objective, the two-stage schedule and the
truncation event the trainer reacts to. No TorchRec import."""

from comera_rec.rank.schedule import ObjectiveTerms, RankSchedule, RankScheduleConfig
from comera_rec.rank.size import (
    model_compression_ratio,
    model_dense_num_parameters,
    model_live_ranks,
    model_num_bytes,
    model_num_parameters,
    model_ranks,
    model_tt_bytes,
    model_tt_size,
    total_live_rank,
)
from comera_rec.rank.truncation import (
    ParameterChange,
    TruncationResult,
    resize_to_state_dict,
    truncate_model,
)

RankAdaptiveObjective = RankSchedule

__all__ = [
    "ObjectiveTerms",
    "ParameterChange",
    "RankAdaptiveObjective",
    "RankSchedule",
    "RankScheduleConfig",
    "TruncationResult",
    "model_compression_ratio",
    "model_dense_num_parameters",
    "model_live_ranks",
    "model_num_bytes",
    "model_num_parameters",
    "model_ranks",
    "model_tt_bytes",
    "model_tt_size",
    "resize_to_state_dict",
    "total_live_rank",
    "truncate_model",
]
