"""The training engine: one loop for every model kind, driven by a task object.

The engine owns the loop (forward, rank-adaptive objective, backward, optimiser steps),
rank truncation and the rebuild it forces, validation metrics over all processes,
checkpoints and resume, and the reports. It knows nothing of the model's kind: a *task*
supplies the model, the wrapper, the batches and the loss.

Task hooks (see :class:`Task`, whose defaults give the optional ones; a task need not
subclass it: the engine looks the optional hooks up with :func:`task_hook`)::

    build_model(device) -> nn.Module            # the unwrapped model, same on every process
    wrap(model) -> nn.Module                    # DDP / DMP / identity; called again after truncation
    train_batches(epoch) -> Iterable            # this process's training batches of one epoch
    val_batches() -> Iterable                   # this process's validation batches
    step_loss(wrapped, batch) -> (loss, logits, labels)
    extra_optimizers(wrapped) -> list           # optional: e.g. TorchRec fused optimisers
    optimizer_parameters(wrapped) -> Iterable   # optional: what the torch optimiser updates
    metrics(device) -> TaskMetrics              # optional: validation metrics (binary by default)
    checkpoint_config_keys() -> list[str]       # optional: config key prefixes a resume may not change
    train_position() -> dict | None             # optional: the rows this process has left in the epoch
    resume_train_position(epoch, positions) -> bool  # optional: seek there (re-split over this run's processes)

Batches must be deterministic given the epoch (so a resumed run can skip the consumed
ones when the task cannot seek) and the wrapper must share its parameters with the model ``build_model`` returned
(DDP does; so do DMP's replicated modules).

This module holds the loop (:meth:`Trainer.fit`) and the optimisers; the rest of
:class:`Trainer` comes from mixins, one module each: ``engine_setup`` (process group, device,
writable folders), ``engine_checkpoint`` (save, resume, compatibility), ``engine_graphs``
(CUDA graphs), ``engine_steps`` (the batches and what every process agrees on per step) and
``engine_report`` (log records, summary). :class:`TrainerConfig` and :class:`Task` are in
``trainer_config``, the checkpoint checks in ``checkpoint_compat``; all importable from here.

Example::

    >>> trainer = Trainer(task, TrainerConfig(run_dir="runs/x", max_steps=100),
    ...                   RankScheduleConfig(truncate_every=20), OptimConfig())  # doctest: +SKIP
    >>> summary = trainer.fit()  # doctest: +SKIP
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from comera_rec.rank.optim_state import retarget_optimizer
from comera_rec.rank.schedule import ObjectiveTerms, RankSchedule, RankScheduleConfig
from comera_rec.tensor.derived import cached_weights
from comera_rec.tensor.kernels import build_cpu_kernels
from comera_rec.training import faults
from comera_rec.training.async_save import PendingCheckpoint, Staging

# re-exported: importable from here as before the engine was split into modules
from comera_rec.training.checkpoint_compat import (  # noqa: F401
    IncompatibleCheckpointError,
    config_differences,
    flatten_config,
    short_repr,
    state_dict_mismatches,
    tt_rank_dims,
)
from comera_rec.training.cuda_graph import CaptureBackend, StepGraphs
from comera_rec.training.dist import is_distributed, process_rank, world_size
from comera_rec.training.engine_checkpoint import TrainerCheckpoints
from comera_rec.training.engine_graphs import TrainerGraphs, eager_cuda_hint
from comera_rec.training.engine_report import TrainerReports
from comera_rec.training.engine_setup import TrainerSetup
from comera_rec.training.engine_steps import TrainerSteps
from comera_rec.training.optim import OptimConfig, build_optimizer
from comera_rec.training.process_state import peak_memory_mb, rng_state, set_rng_state  # noqa: F401
from comera_rec.training.report import JsonlLog
from comera_rec.training.rundir import RunDir, open_run_dir
from comera_rec.training.step import EagerStep, GraphedStep, Step, check_forward_precision, forward_precision
from comera_rec.training.stop import StopSignals, TrainingStopped
from comera_rec.training.trainer_config import Task, TrainerConfig, task_hook
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory

logger = logging.getLogger(__name__)

_NO_BATCH = object()  # what next() gives when this process's batches are exhausted


class Trainer(TrainerSetup, TrainerCheckpoints, TrainerGraphs, TrainerSteps, TrainerReports):
    """Runs a task under the rank-adaptive schedule; see the module docstring.

    Args:
        task: the model kind (see :class:`Task`).
        config: the loop settings.
        schedule: the rank-adaptive objective settings.
        optim: the torch optimiser settings.
        run_config: the whole run's config (any dataclass), saved into checkpoints'
            meta.json for the record.
        graph_capture: with ``config.cuda_graphs``, the capture backend (for tests:
            ``cuda_graph.EagerCapture`` runs the graphed step eagerly, on any device);
            ``None`` captures CUDA graphs.

    Attributes:
        model: the unwrapped model; ``wrapped`` the wrapper; ``optimizers`` all optimisers
            (the torch one first); ``step`` optimiser steps taken (skipped batches count);
            ``losses`` the global task loss of every step run in this process's life;
            ``process_rank`` this process's rank in the run (0 alone), set by ``fit()``: the
            summary files are rank 0's.
    """

    def __init__(
        self,
        task: Task,
        config: TrainerConfig,
        schedule: Optional[RankScheduleConfig] = None,
        optim: Optional[OptimConfig] = None,
        run_config: Any = None,
        *,
        graph_capture: Optional[CaptureBackend] = None,
    ) -> None:
        self.task = task
        self.config = config
        # cuda_graphs: a capture backend other than CUDA's (tests pass EagerCapture to run the
        # graphed step on a CPU); None captures with torch.cuda.graph
        self._graph_capture = graph_capture
        self._graphs: Optional[StepGraphs] = None
        self._capturable = False
        self.schedule = RankSchedule(schedule or RankScheduleConfig())
        self.optim_config = optim or OptimConfig()
        self.run_config = run_config
        self.run_dir = Path(config.run_dir)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self._positioned = False  # a resume handed the task its saved data position
        self.nonfinite = 0
        self.truncations = 0
        self.samples = 0
        self.losses: list[float] = []
        self.process_rank = 0
        self.last_eval: dict[str, float] = {}
        self._owns_group = False
        self.model: Optional[nn.Module] = None
        self.wrapped: Optional[nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.extra: list[Any] = []
        self._stop: Optional[StopSignals] = None  # set by fit(): SIGINT / SIGTERM seen
        self._saved: Optional[tuple[int, Path]] = None  # (step, folder) of the newest checkpoint
        self._pending: Optional[PendingCheckpoint] = None  # a background save in flight
        self._staging = Staging()  # CPU buffers the background saves copy into, kept between saves
        self._run_dir: Optional[RunDir] = None  # set by fit(): the locked run directory and run id

    @property
    def optimizers(self) -> list[Any]:
        return ([self.optimizer] if self.optimizer is not None else []) + list(self.extra)

    def _build_optimizers(self, truncation: Any = None) -> None:
        if self.optimizer is None:
            params = task_hook(self.task, "optimizer_parameters")(self.wrapped)
            include = None if params is None else list(params)  # None: all of the model's
            self.optimizer = build_optimizer(self.model, self.optim_config, include, self._capturable)
        elif truncation is not None:
            # the path RankAdapter users take: the same optimiser, pointed at the cut
            # parameters with its state sliced (comera_rec/rank/optim_state.py)
            retarget_optimizer(self.optimizers, truncation)
        self.extra = list(task_hook(self.task, "extra_optimizers")(self.wrapped))

    def _zero_grad(self) -> None:
        if self._graphs is not None and self._graphs.holds_grads:
            return  # the captured backward writes the gradients in place; the graph zeroes them
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True) if isinstance(opt, torch.optim.Optimizer) else opt.zero_grad()
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None

    def _rebuild_after_truncation(self) -> None:
        if self._graphs is not None:
            self._graphs.invalidate()  # new parameter shapes and optimiser: capture again
        self._zero_grad()
        old_wrapped = self.wrapped
        self.wrapped = None
        del old_wrapped
        self.wrapped = self.task.wrap(self.model)
        self._build_optimizers(self.schedule.last_truncation)

    # ------------------------------------------------------------------ metrics
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation metrics over all processes (collective): the task's own
        ``metrics(device)`` (by default AUC, accuracy and log loss)."""
        metrics = task_hook(self.task, "metrics")(self.device)
        self.wrapped.eval()
        try:
            batches = self.task.val_batches()
            if self.config.eval_max_batches:
                batches = itertools.islice(batches, self.config.eval_max_batches)
            precision = forward_precision(self.device, self.config.autocast)
            with cached_weights(), precision:  # the parameters cannot change while validating
                for batch in batches:
                    _, logits, labels = self.task.step_loss(self.wrapped, batch)
                    metrics.update(logits, labels)
            result = metrics.compute()
        finally:
            self.wrapped.train()
        self.last_eval = result
        self.schedule.observe_validation(self.step, result["log_loss"], self.model)
        return result

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        """Train to the end, then validate, checkpoint, plot and summarise.

        SIGINT and SIGTERM stop the run after the current step: every process agrees, a
        checkpoint is written and :class:`~comera_rec.training.stop.TrainingStopped` (a
        ``SystemExit`` with code 130 / 143) is raised; a second signal aborts at once. The
        handlers are installed for the duration of the call only.

        Returns:
            The summary (also printed on rank 0 and saved as summary.txt / summary.json).
        """
        with StopSignals() as self._stop:
            try:
                summary = self._fit()
            except TrainingStopped:
                # every process agreed on the stop and left the loop together: the group is usable
                self.close()
                raise
            except BaseException:
                # another process may be waiting in a collective: destroying the group could
                # block forever, so leave it to the process exit (torchrun sees the failure)
                self.close(destroy_group=False)
                raise
            self.close()
        self._stop = None
        return summary

    def _fit(self) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.config
        log, total, start_step = self._start_run()
        rank = self.process_rank
        bar = tqdm(
            total=total, initial=start_step, disable=not (cfg.progress and rank == 0), dynamic_ncols=True, desc="train"
        )
        batches = self._batches()
        window_loss, window_steps, window_samples, window_time = 0.0, 0, 0, 0.0
        throughputs: list[float] = []
        wall0 = time.perf_counter()
        self.wrapped.train()
        self._zero_grad()
        if cfg.cuda_graphs:
            self._start_graphs()
        if cfg.freeze_gc:
            freeze_live_objects()  # close() unfreezes them, so that they can be freed
        while total is None or self.step < total:
            t0 = time.perf_counter()
            batch = next(batches, _NO_BATCH)
            # every process agrees whether all still have a batch and whether a signal asks to stop
            out_of_batches, signum = self._step_flags(batch is not _NO_BATCH)
            if out_of_batches:
                if is_distributed():
                    self._report_uneven(batch is not _NO_BATCH, batches)
                break
            if signum:
                bar.close()
                self._stop_on_signal(signum)
            done = self._train_step(batch, total)
            if done is None:  # a non-finite loss or gradients: the batch was skipped (and counted)
                bar.update(1)
                continue
            global_loss, terms, n, truncated = done
            window_time += time.perf_counter() - t0
            window_loss += global_loss
            window_steps += 1
            window_samples += n
            bar.update(1)
            if truncated and log is not None:
                self._log_truncation(log)
            if cfg.log_every and self.step % cfg.log_every == 0:
                tput = window_samples / max(window_time, 1e-9)
                throughputs.append(tput)
                record = self._train_record(window_loss / window_steps, terms, tput)
                if log is not None:
                    log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", cr=f"{record['compression']:.1f}")
                window_loss, window_steps, window_samples, window_time = 0.0, 0, 0, 0.0
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                result = self.evaluate()
                if log is not None:
                    log.write({"kind": "eval", "step": self.step, **result, "stage": self.schedule.stage})
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save(background=cfg.async_checkpoint)
        bar.close()
        self._finish_run(log)
        summary = self._summary(throughputs, wall0)
        if rank == 0:
            self._write_summary(summary, log)
        return summary

    def _start_run(self) -> tuple[Optional[JsonlLog], Optional[int], int]:
        """Everything before the first step: the process group, the device, the checks that
        the run can finish, the run directory, the seeds, the model and its wrapper and
        optimisers (restored when resuming), the log and the schedule's length.

        Returns:
            The log (rank 0; None on the others), the run's steps (None: epoch-bounded) and
            the step it starts at.
        """
        cfg = self.config
        self._init_distributed()
        self.device = self._device()
        check_forward_precision(self.device, cfg.autocast)
        if cfg.cuda_graphs:
            self._check_cuda_graphs()
        hint = eager_cuda_hint(self.device, cfg.cuda_graphs, world_size())
        if hint and process_rank() == 0:
            logger.info(hint)
        # before anything is built or written: a run that cannot finish fails now
        resume_from = self._resume_checkpoint()
        self._check_writable()
        # lock run_dir, refuse a fresh start over another run, agree on the run id (rundir.py)
        self._run_dir = open_run_dir(self.run_dir, resume_from, cfg.resume, cfg.overwrite)
        if cfg.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        if self.device.type == "cpu":
            # a build of the fused kernels happens now, not inside the first step (whose
            # time would make the progress bar's ETA read hours); "building" / "built" lines
            # at INFO, "already built" at DEBUG
            build_cpu_kernels(say=lambda line: (logger.info if line.startswith("buil") else logger.debug)(line))
        rank = self.process_rank = process_rank()
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.model = self.task.build_model(self.device)
        self._rng_to_restore: Optional[dict[str, Any]] = None
        if resume_from is not None:
            self._restore(resume_from)
            self._saved = (self.step, resume_from)  # a stop before the next step need not save again
        else:
            self.wrapped = self.task.wrap(self.model)
            self._build_optimizers()
        start_step = self.step
        log = (
            JsonlLog(self.run_dir / "log.jsonl", resume_step=start_step if resume_from else None) if rank == 0 else None
        )
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore, self.device)
        total = cfg.max_steps if cfg.max_steps > 0 else None
        self.schedule.set_total_steps(total if total is not None else self._epoch_steps())
        return log, total, start_step

    def _train_step(self, batch: Any, total: Optional[int]) -> Optional[tuple[float, ObjectiveTerms, int, bool]]:
        """One training step on ``batch`` (collective): forward, objective and backward (graph
        replays or eager), the non-finite checks, the optimiser steps and a truncation when due.

        Args:
            batch: this process's batch.
            total: the run's steps (None: epoch-bounded), for the learning-rate schedule.

        Returns:
            ``(global task loss, objective terms, samples over all processes, whether it
            truncated)``, or None when the batch was skipped as non-finite.
        """
        cfg = self.config
        # graphed: replays (after warm-up) of forward + objective + backward, then of clip +
        # optimiser steps; eager otherwise (comera_rec/training/step.py)
        step: Step = GraphedStep(self) if self._graphs is not None and self._graphs_usable() else EagerStep(self)
        loss, labels = step.forward(batch)
        global_loss, finite = self._reduce_loss(loss)
        self.batch_in_epoch += 1
        if not finite:
            self._skip_nonfinite("loss")
            return None
        terms = step.backward(loss, global_loss)
        if cfg.check_grads and not self._grads_finite():
            self._skip_nonfinite("gradients")
            return None
        self.schedule.observe_gradients(self.model)  # slice costs for the budget's cuts
        step.update(total)
        self._zero_grad()
        self.step += 1
        faults.maybe_kill(faults.KILL_AT_STEP, self.step, self.process_rank, self.run_dir)
        n = int(labels.shape[0]) * world_size()
        self.samples += n
        self.losses.append(global_loss)
        truncated = False
        if self.schedule.should_truncate(self.step) and self.schedule.truncate(self.model, self.step):
            self._rebuild_after_truncation()
            self.truncations += 1
            truncated = True
        return global_loss, terms, n, truncated

    def _finish_run(self, log: Optional[JsonlLog]) -> None:
        """After the last step (collective): validate unless this step's validation ran,
        checkpoint unless this step's checkpoint is written, and wait for a background save."""
        cfg = self.config
        if not (cfg.eval_every and self.step % cfg.eval_every == 0 and self.last_eval):
            result = self.evaluate()
            if log is not None:
                log.write({"kind": "eval", "step": self.step, **result, "stage": self.schedule.stage})
        if cfg.checkpoint_at_end and not (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
            self.save()
        self.wait_for_checkpoint()  # the run ends with its last checkpoint complete

    def close(self, destroy_group: bool = True) -> None:
        """Release the wrapper and optimisers, then the process group if the engine made it.

        Deleting them and collecting garbage before ``destroy_process_group`` avoids the
        gloo abort at exit (platform.md). ``destroy_group=False`` (after an error) leaves
        the group to the process exit.
        """
        if self._pending is not None:  # after an error: let a background save finish, but not raise over it
            try:
                self.wait_for_checkpoint()
            except Exception as e:
                logger.error("the background checkpoint failed: %s", e)
        self._graphs = None  # frees the graphs' memory pools
        self.wrapped = None
        self.optimizer = None
        self.extra = []
        gc.unfreeze()  # what freeze_gc froze (the model among it) is collectable again
        gc.collect()
        if self._run_dir is not None:
            self._run_dir.release()  # the run_dir lock (rundir.py)
            self._run_dir = None
        if destroy_group and self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
