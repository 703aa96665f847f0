"""DLRM as a task of the training engine: model, wrapping, data and loss.

The engine (``comera_rec.training``) knows nothing of DLRM; this module supplies what it
asks for (see ``comera_rec.training.engine.Task``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.optim.keyed import KeyedOptimizer

from comera_rec.config import load_config
from comera_rec.data import DataConfig, build_dataloaders, num_embeddings, set_epoch
from comera_rec.data.position import resume_position
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.model import build_dlrm_train
from comera_rec.integration.distributed import (
    EmbeddingOptimizerSpec,
    replicated_parameter_groups,
    rewrap_data_parallel,
    wrap_model,
)
from comera_rec.rank import RankScheduleConfig
from comera_rec.training import OptimConfig, Task, TrainerConfig
from comera_rec.training.cuda_graph import capturing


@dataclass
class EmbeddingOptimConfig:
    """The optimiser of the dense (uncompressed) tables, fused into the backward pass."""

    name: str = "RowWiseAdagrad"
    """"RowWiseAdagrad" (FBGEMM's exact row-wise Adagrad), "Adagrad" or "SGD"."""
    lr: float = 0.01
    """Learning rate of the dense tables."""
    eps: float = 1e-8
    """Adagrad epsilon (MLPerf DLRM-DCNv2: 1e-8)."""
    sharding_type: Optional[str] = None
    """Sharding of the dense tables under DMP: "table_wise", "column_wise",
    "table_column_wise" ("row_wise" and "data_parallel" on GPUs only), or null to let
    TorchRec's planner choose among those. On CPU "data_parallel" is refused: FBGEMM's CPU
    dense lookup has no autograd kernel, so replicated tables would never train."""

    def spec(self) -> EmbeddingOptimizerSpec:
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        classes = {"RowWiseAdagrad": RowWiseAdagrad, "Adagrad": torch.optim.Adagrad, "SGD": torch.optim.SGD}
        if self.name not in classes:
            raise ValueError(f"embedding_optim.name must be one of {sorted(classes)}, got {self.name!r}")
        kwargs: dict[str, Any] = {"lr": self.lr}
        if self.name != "SGD":
            kwargs["eps"] = self.eps
        return EmbeddingOptimizerSpec(classes[self.name], kwargs)


@dataclass
class DLRMRunConfig:
    """A whole DLRM training run, as read from ``configs/*.yaml`` plus overrides."""

    model: DLRMConfig = field(default_factory=DLRMConfig)
    """The model (tables, MLPs, interaction, compression policy)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where batches come from (synthetic, Criteo TSV / Parquet / npy)."""
    schedule: RankScheduleConfig = field(default_factory=RankScheduleConfig)
    """The rank-adaptive objective and truncation schedule."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The torch optimiser of TT cores, controllers and dense layers."""
    embedding_optim: EmbeddingOptimConfig = field(default_factory=EmbeddingOptimConfig)
    """The fused optimiser of the dense tables."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop length, intervals, run directory, checkpoints."""
    table_sizes_from_data: bool = True
    """Take the model's table sizes from the data (vocabularies / synthetic sizes)."""


def load_run_config(path: Optional[str], overrides: Iterable[str] = ()) -> DLRMRunConfig:
    """Read a run config; ``overrides`` are ``section.key=value`` strings.

    Example::

        >>> cfg = load_run_config(None, ["trainer.max_steps=5", "model.rank=8"])
        >>> cfg.trainer.max_steps, cfg.model.rank
        (5, 8)
    """
    return load_config(DLRMRunConfig, path, list(overrides))


def check_run_config(config: DLRMRunConfig) -> None:
    """Checks across sections that no single section can make, run before training starts.

    The trainer validates at the end of every run (and every ``trainer.eval_every`` steps),
    so the data must give a validation set: synthetic data always does; files need
    ``data.val_paths`` or a hold-out (``data.holdout`` other than ``"none"``).

    Args:
        config: the whole run config.

    Raises:
        ValueError: no validation set; the message names data.holdout, data.val_paths and
            trainer.eval_every.
    """
    data = config.data
    if data.source != "synthetic" and data.holdout == "none" and not data.val_paths:
        when = (
            f"every trainer.eval_every={config.trainer.eval_every} steps and at the end"
            if config.trainer.eval_every
            else "at the end of the run (it always does)"
        )
        raise ValueError(
            f"the data config gives no validation set (data.holdout='none' and data.val_paths is empty), but "
            f"the trainer validates {when}; set data.val_paths to validation files, or data.holdout to "
            f"'kaggle' or 'last_file' to hold out part of data.train_paths"
        )


class DLRMTask(Task):
    """The engine's view of a DLRM run.

    Args:
        config: the run config; ``data.rank`` / ``data.world_size`` are taken from the
            process group when one exists.

    Raises:
        ValueError: the config cannot run to its end (see :func:`check_run_config`).

    Example::

        >>> task = DLRMTask(load_run_config(None, ["data.batch_size=8"]))  # doctest: +SKIP
        >>> Trainer(task, task.config.trainer, task.config.schedule, task.config.optim).fit()  # doctest: +SKIP
    """

    def __init__(self, config: DLRMRunConfig) -> None:
        check_run_config(config)
        self.config = config
        self.fused_optimizer: Optional[KeyedOptimizer] = None
        """The dense tables' optimiser, fused into backward (set by :meth:`wrap`)."""
        self._wrapped: Optional[nn.Module] = None
        self.device = torch.device("cpu")
        self._train: Optional[Iterable[Batch]] = None
        self._val: Optional[Iterable[Batch]] = None

    # ------------------------------------------------------------------ model
    def build_model(self, device: torch.device) -> nn.Module:
        cfg = self.config
        self.device = device
        if cfg.table_sizes_from_data:
            sizes = num_embeddings(self._data_config())
            if len(sizes) != len(cfg.model.table_sizes):
                raise ValueError(
                    f"the data has {len(sizes)} categorical features but model.table_sizes has "
                    f"{len(cfg.model.table_sizes)} tables"
                )
            cfg.model.table_sizes = list(sizes)
        return build_dlrm_train(cfg.model, device=device)

    def wrap(self, model: nn.Module) -> nn.Module:
        """DMP on the first call; after a truncation, rebuild its DDP wrapper only."""
        if self._wrapped is None:
            self._wrapped, self.fused_optimizer = wrap_model(
                model,
                device=self.device,
                embedding_optimizer=self.config.embedding_optim.spec(),
                sharding_type=self.config.embedding_optim.sharding_type,
            )
        else:  # the Trainer has pointed its optimiser at the cut parameters (as RankAdapter does)
            self._wrapped = rewrap_data_parallel(self._wrapped)
        return self._wrapped

    def optimizer_parameters(self, wrapped: nn.Module) -> list[nn.Parameter]:
        """Everything replicated: TT cores, controllers, MLPs (not the dense tables)."""
        groups = replicated_parameter_groups(wrapped)
        return [p for k in ("cores", "controllers", "other") for p in groups[k]]

    def extra_optimizers(self, wrapped: nn.Module) -> list[Any]:
        """DMP's fused optimiser of sharded tables (its state goes into checkpoints)."""
        return [self.fused_optimizer] if self.fused_optimizer is not None else []

    def checkpoint_config_keys(self) -> list[str]:
        """Config keys a resumed run must share with its checkpoint: the whole model section."""
        return ["model."]

    # ------------------------------------------------------------------ data
    def _data_config(self) -> DataConfig:
        data = self.config.data
        if dist.is_available() and dist.is_initialized():
            data.rank, data.world_size = dist.get_rank(), dist.get_world_size()
        if data.num_embeddings_per_feature is None and data.source == "synthetic":
            data.num_embeddings_per_feature = list(self.config.model.table_sizes)
        return data

    def _loaders(self) -> None:
        if self._train is None:
            self._train, self._val = build_dataloaders(self._data_config())

    def train_batches(self, epoch: int) -> Iterable[Batch]:
        self._loaders()
        set_epoch(self._train, epoch)
        return self._train

    def train_position(self) -> Optional[dict[str, Any]]:
        """The training reader's rows left in the epoch (None with DataLoader workers, whose
        readers live in other processes, and for an endless synthetic stream)."""
        position = getattr(self._train, "position", None)  # a DataLoader has none
        if position is None:
            return None
        pos = position()
        return None if pos is None else pos.to_state()

    def resume_train_position(self, epoch: int, positions: Sequence[dict[str, Any]]) -> bool:
        """Point the training reader at this process's part of the rows the saved run had left."""
        self._loaders()
        if not hasattr(self._train, "resume"):
            return False
        data = self._data_config()
        set_epoch(self._train, epoch)
        self._train.resume(resume_position(positions, data.rank, data.world_size, data.batch_size))
        return True

    def val_batches(self) -> Iterable[Batch]:
        self._loaders()
        if self._val is None:
            raise ValueError("the data config gives no validation set (holdout: none and no val_paths)")
        return self._val

    # ------------------------------------------------------------------ loss
    def check_batch(self, batch: Batch) -> None:
        """:func:`check_batch` of a training batch, unless ``model.validate_inputs`` is off
        (the graphed step calls this on the host before each replay)."""
        if self.config.model.validate_inputs:
            check_batch(batch, self.config.model.dense_in_features)

    def step_loss(self, wrapped: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not capturing():  # inside a capture the engine has checked the batch already
            self.check_batch(batch)
        loss, (_, logits, labels) = wrapped(batch.to(self.device))
        return loss, logits, labels


def check_batch(batch: Batch, dense_in_features: int) -> None:
    """Check a training batch's dense features and labels (the sparse ids are checked by the model).

    Raises:
        TypeError: a field of the wrong type or dtype.
        ValueError: a wrong shape, or labels other than 0 / 1.
    """
    if not isinstance(batch, Batch):
        raise TypeError(f"expected a torchrec Batch, got {type(batch).__name__}")
    dense, labels = batch.dense_features, batch.labels
    if dense.dtype != torch.float32:
        raise TypeError(f"batch.dense_features must be float32, got {dense.dtype}")
    if dense.dim() != 2 or dense.shape[1] != dense_in_features:
        raise ValueError(
            f"batch.dense_features must have shape [B, {dense_in_features}] "
            f"(model.dense_in_features), got {list(dense.shape)}"
        )
    if not labels.dtype.is_floating_point:
        raise TypeError(f"batch.labels must be floating point (0.0 / 1.0), got {labels.dtype}")
    if labels.shape != (dense.shape[0],):
        raise ValueError(f"batch.labels must have shape [{dense.shape[0]}] (one per row), got {list(labels.shape)}")
    if labels.numel() and bool(((labels != 0) & (labels != 1)).any()):
        bad = float(labels[(labels != 0) & (labels != 1)][0])
        hint = " (a file without labels, e.g. Kaggle test.txt?)" if bad == -1 else ""
        raise ValueError(f"batch.labels must be 0 or 1 for training, got {bad}{hint}")
