"""The training engine that knows nothing of the model's kind: loop, optimisers,
metrics, checkpoints and reports."""

from comera_rec.training.adamw import GroupStepAdamW
from comera_rec.training.checkpoint import (
    CheckpointError,
    NonFiniteStateError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from comera_rec.training.engine import IncompatibleCheckpointError, Task, Trainer, TrainerConfig, peak_memory_mb
from comera_rec.training.metrics import BinaryMetrics
from comera_rec.training.optim import OptimConfig, build_optimizer, rebuild_optimizer
from comera_rec.training.report import JsonlLog, plot_run, read_jsonl, summary_table
from comera_rec.training.trainer_config import task_hook

__all__ = [
    "BinaryMetrics",
    "CheckpointError",
    "GroupStepAdamW",
    "IncompatibleCheckpointError",
    "JsonlLog",
    "NonFiniteStateError",
    "OptimConfig",
    "Task",
    "Trainer",
    "TrainerConfig",
    "build_optimizer",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "peak_memory_mb",
    "plot_run",
    "read_jsonl",
    "rebuild_optimizer",
    "save_checkpoint",
    "summary_table",
    "task_hook",
]
