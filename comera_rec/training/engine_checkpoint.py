"""The trainer's checkpoints: which one to resume from, saving (blocking or in the
background), the compatibility check and the restore (:class:`TrainerCheckpoints`, a mixin
of :class:`~comera_rec.training.engine.Trainer`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from comera_rec.config import to_dict
from comera_rec.rank.schedule import RankSchedule
from comera_rec.rank.size import model_ranks
from comera_rec.rank.truncation import resize_to_state_dict
from comera_rec.training.async_save import PendingCheckpoint, Staging, save_checkpoint_async
from comera_rec.training.checkpoint import (
    SHARED_KEY,
    latest_checkpoint,
    load_checkpoint,
    restore_local,
    save_checkpoint,
)
from comera_rec.training.checkpoint_compat import IncompatibleCheckpointError, config_differences, state_dict_mismatches
from comera_rec.training.dcp_state import restore_shared, shared_model_shapes, shared_state
from comera_rec.training.dist import is_distributed, process_rank, restart_count, world_size
from comera_rec.training.process_state import rng_state
from comera_rec.training.rundir import RunDir
from comera_rec.training.trainer_config import Task, TrainerConfig, task_hook

# the Trainer's records keep the engine's logger name
logger = logging.getLogger("comera_rec.training.engine")


class TrainerCheckpoints:
    """Mixin of :class:`~comera_rec.training.engine.Trainer`: its checkpoint methods.

    It relies on these attributes of the trainer: ``config``, ``task``, ``run_config``,
    ``run_dir``, ``device``, ``schedule``, ``model``, ``wrapped``, ``optimizer``, ``extra``,
    the position and counters (``step``, ``epoch``, ``batch_in_epoch``, ``nonfinite``,
    ``truncations``, ``samples``, ``last_eval``), ``_saved``, ``_pending``, ``_staging`` and
    ``_run_dir``; and on its :meth:`_build_optimizers`. :meth:`_restore` sets
    ``_rng_to_restore`` (the RNG state ``fit()`` installs once set up).
    """

    config: TrainerConfig
    task: Task
    run_config: Any
    run_dir: Path
    device: torch.device
    schedule: RankSchedule
    model: Optional[nn.Module]
    wrapped: Optional[nn.Module]
    optimizer: Optional[torch.optim.Optimizer]
    extra: list[Any]
    step: int
    epoch: int
    batch_in_epoch: int
    nonfinite: int
    truncations: int
    samples: int
    last_eval: dict[str, float]
    _saved: Optional[tuple[int, Path]]
    _pending: Optional[PendingCheckpoint]
    _staging: Staging
    _run_dir: Optional[RunDir]
    _rng_to_restore: Optional[dict[str, Any]]
    _positioned: bool
    _build_optimizers: Callable[..., None]

    def _resume_checkpoint(self) -> Optional[Path]:
        """The checkpoint to resume from: the newest complete one in ``run_dir/checkpoints``
        with ``resume`` or after a torchrun restart, else None.

        Raises:
            FileNotFoundError: ``resume`` is set, there is no complete checkpoint, this is
                not a torchrun restart (whose first attempt may have written none) and
                ``resume_missing_ok`` is off; the message names the folder.
        """
        cfg = self.config
        restarts = restart_count()
        folder = self.run_dir / "checkpoints"
        resume_from = latest_checkpoint(folder) if cfg.resume or restarts > 0 else None
        if restarts > 0 and process_rank() == 0:
            logger.warning(
                "torchrun restart %d: %s",
                restarts,
                f"resuming from {resume_from}" if resume_from else "no checkpoint yet, starting afresh",
            )
        if cfg.resume and resume_from is None and restarts == 0:
            if not cfg.resume_missing_ok:
                where = "does not exist" if not folder.is_dir() else "holds no complete checkpoint"
                raise FileNotFoundError(
                    f"trainer.resume (--resume): {folder} {where}, so there is nothing to resume from; check "
                    f"trainer.run_dir={cfg.run_dir!r}, or set trainer.resume_missing_ok=true to start afresh "
                    f"when there is no checkpoint"
                )
            if process_rank() == 0:
                logger.warning(
                    "trainer.resume: no complete checkpoint in %s, starting afresh (trainer.resume_missing_ok)", folder
                )
        return resume_from

    def _state(self) -> dict[str, Any]:
        """This process's own state (the rank file); the model and optimisers are shared."""
        return {
            "schedule": self.schedule.state_dict(),
            "trainer": {
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "nonfinite": self.nonfinite,
                "truncations": self.truncations,
                "samples": self.samples,
                "last_eval": dict(self.last_eval),
                "data_positions": self._data_positions(),
            },
            "rng": rng_state(self.device),
        }

    def _data_positions(self) -> Optional[list[dict[str, Any]]]:
        """Every process's training-data position, by rank (collective; the same list in
        every rank file, so any process of a resized run finds them all); None when some
        process's task cannot tell its position (the batch count is used then)."""
        mine = task_hook(self.task, "train_position")()
        gathered: list[Any] = [mine]
        if is_distributed():
            gathered = [None] * world_size()
            dist.all_gather_object(gathered, mine)
        return None if any(p is None for p in gathered) else gathered

    def save(self, background: bool = False) -> Path:
        """Checkpoint now (collective: every process calls it).

        Args:
            background: write it in a background thread (:mod:`comera_rec.training.async_save`);
                call :meth:`wait_for_checkpoint` before relying on it. A save in flight is
                waited for first either way.

        Returns:
            The checkpoint's folder (complete once a background save finished).
        """
        self.wait_for_checkpoint()
        meta = {"ranks": model_ranks(self.model), "time": time.time()}
        if self.run_config is not None:
            meta["config"] = to_dict(self.run_config)
        # pruning only deletes this run's checkpoints
        run_id = self._run_dir.run_id if self._run_dir is not None else None
        args = (self.run_dir / "checkpoints", self.step, self._state(), meta)
        kwargs = dict(
            keep=self.config.keep_checkpoints,
            run_id=run_id,
            shared=shared_state(self.model, self.optimizer, self.extra),
        )
        if background:
            self._pending = save_checkpoint_async(*args, **kwargs, staging=self._staging)
            path = self._pending.path
        else:
            path = save_checkpoint(*args, **kwargs)
        self._saved = (self.step, path)
        return path

    def wait_for_checkpoint(self) -> Optional[Path]:
        """Block until a background save in flight is complete (its folder; None when none
        was in flight). Raises what the writer raised."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        path = pending.wait()
        logger.debug(
            "background checkpoint %s: training held %.3f s, written in %.2f s", path, pending.stall_s, pending.write_s
        )
        return path

    def _check_compatible(self, path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Refuse a checkpoint whose model (keys, shapes, the task's fixed config keys) differs."""
        problems = state_dict_mismatches(self.model, state["model"])
        diffs = config_differences(meta.get("config"), to_dict(self.run_config)) if self.run_config is not None else []
        # config sections that define the model (the task says which): any change there is fatal
        fixed = tuple(task_hook(self.task, "checkpoint_config_keys")())
        problems += [f"config {d}" for d in diffs if fixed and d.startswith(fixed)]
        if problems:
            shown = problems[:12] + ([f"... {len(problems) - 12} more"] if len(problems) > 12 else [])
            hint = f"; the run config differs from the checkpoint's in: {'; '.join(diffs[:10])}" if diffs else ""
            raise IncompatibleCheckpointError(
                f"checkpoint {path} does not fit this model: "
                + "; ".join(shown)
                + hint
                + ". Resume with the configuration it was written with, or use another trainer.run_dir."
            )
        if diffs and process_rank() == 0:
            logger.warning("resuming from %s with config changes: %s", path, "; ".join(diffs))

    def _restore(self, path: Path) -> None:
        state, meta = load_checkpoint(path, shared=False)
        skeleton = state.pop(SHARED_KEY, None)
        if skeleton is None:  # a checkpoint of the per-process format (same world size)
            self._restore_local(path, state, meta)
        else:
            shapes = shared_model_shapes(path, skeleton)
            self._check_compatible(path, {"model": shapes}, meta)
            resize_to_state_dict(self.model, shapes)
            # wrap first: sharded tables exist only once the model is sharded again
            self.wrapped = self.task.wrap(self.model)
            self._build_optimizers()
            restore_shared(path, skeleton, self.model, self.optimizer, self.extra)
        self.schedule.load_state_dict(state["schedule"])
        t = state["trainer"]
        self.step, self.epoch, self.batch_in_epoch = int(t["step"]), int(t["epoch"]), int(t["batch_in_epoch"])
        self.nonfinite, self.truncations, self.samples = int(t["nonfinite"]), int(t["truncations"]), int(t["samples"])
        self.last_eval = {str(k): float(v) for k, v in dict(t.get("last_eval", {})).items()}
        self._rng_to_restore = state["rng"]
        self._position_data(path, t.get("data_positions"), int(meta.get("world_size", 1)))

    def _position_data(self, path: Path, positions: Optional[list[dict[str, Any]]], saved_world: int) -> None:
        """Hand the saved data positions to the task (it seeks to them, re-splitting the rest
        of the epoch over this run's processes), or fall back to skipping batches."""
        accepted = positions is not None and bool(task_hook(self.task, "resume_train_position")(self.epoch, positions))
        if is_distributed():  # every process must agree, or some would skip batches and others seek
            flag = torch.tensor([int(accepted)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if accepted and not bool(flag):
                raise RuntimeError("data position: some processes could not seek to the saved position, others did")
        self._positioned = accepted
        if process_rank() != 0:
            return
        if accepted:
            logger.info(
                "resuming the data of epoch %d at the saved row position (%d process(es) wrote it, %d resume)",
                self.epoch,
                len(positions or []),
                world_size(),
            )
        elif saved_world != world_size():
            logger.warning(
                "resuming %s, written by %d process(es), with %d: the model and optimiser state are "
                "resharded; the data position is a batch count (batch %d of each process's part), "
                "so within this epoch some rows are used twice and others not at all",
                path,
                saved_world,
                world_size(),
                self.batch_in_epoch,
            )

    def _restore_local(self, path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Load a checkpoint whose rank files hold the model and local shards."""
        self._check_compatible(path, state, meta)
        resize_to_state_dict(self.model, state["model"])
        self.wrapped = self.task.wrap(self.model)
        self.model.load_state_dict(restore_local(self.model.state_dict(), state["model"], "model"))
        self._build_optimizers()
        self.optimizer.load_state_dict(state["optimizer"])
        if len(state["extra_optimizers"]) != len(self.extra):
            raise ValueError(
                f"{path}: checkpoint has {len(state['extra_optimizers'])} extra optimizers, the task {len(self.extra)}"
            )
        for opt, sd in zip(self.extra, state["extra_optimizers"]):
            opt.load_state_dict(restore_local(opt.state_dict(), sd, "extra_optimizers"))
