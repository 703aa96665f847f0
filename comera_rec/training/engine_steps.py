"""The trainer's steps around the loop body: the training batches from the saved position
on, and what every process of a run agrees on at each step: whether all still have a batch,
whether a signal asks to stop, whether the loss and gradients are finite, and what a stop or
a skipped batch does (:class:`TrainerSteps`, a mixin of
:class:`~comera_rec.training.engine.Trainer`). With one process the checks cost no collective."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from comera_rec.rank.schedule import RankSchedule
from comera_rec.training.checkpoint import NonFiniteStateError
from comera_rec.training.dist import is_distributed, process_rank, world_size
from comera_rec.training.stop import StopSignals, TrainingStopped, signal_name
from comera_rec.training.trainer_config import Task, TrainerConfig

# the Trainer's records keep the engine's logger name
logger = logging.getLogger("comera_rec.training.engine")


class TrainerSteps:
    """Mixin of :class:`~comera_rec.training.engine.Trainer`: the batches, per-step checks and stops.

    It relies on these attributes of the trainer: ``config``, ``task``, ``schedule``,
    ``device``, ``model``, the data position ``epoch`` and ``batch_in_epoch`` (which
    :meth:`_batches` advances into new epochs), ``step`` and ``nonfinite`` (which
    :meth:`_skip_nonfinite` advances), ``_stop`` (the signals seen, None outside ``fit()``)
    and ``_saved`` (the newest checkpoint); and on its :meth:`_zero_grad`, :meth:`save` and
    :meth:`wait_for_checkpoint`.
    """

    config: TrainerConfig
    task: Task
    schedule: RankSchedule
    epoch: int
    batch_in_epoch: int
    _positioned: bool  # the task seeks to the saved data position (no batches to skip)
    device: torch.device
    model: Optional[nn.Module]
    step: int
    nonfinite: int
    _stop: Optional[StopSignals]
    _saved: Optional[tuple[int, Path]]
    _zero_grad: Callable[[], None]
    save: Callable[..., Path]
    wait_for_checkpoint: Callable[[], Optional[Path]]

    def _epoch_steps(self) -> Optional[int]:
        """Steps of an epoch-bounded run when the task's batches have a length, else None
        (the budget rank schedule then cannot plan its cuts, and says so)."""
        try:
            steps = self.config.epochs * len(self.task.train_batches(0))  # type: ignore[arg-type]
        except TypeError:
            steps = 0
        if steps > 0:
            return steps
        if self.schedule.budget and process_rank() == 0:
            logger.warning(
                "the budget rank schedule needs the run's length (trainer.max_steps); training at the starting ranks"
            )
        return None

    def _batches(self) -> Iterator[Any]:
        """Training batches from the saved position on, wrapping into new epochs."""
        while True:
            if self.config.max_steps == 0 and self.epoch >= self.config.epochs:
                return
            it = iter(self.task.train_batches(self.epoch))
            if self.batch_in_epoch and not self._positioned:  # no row position: skip what was consumed
                it = itertools.islice(it, self.batch_in_epoch, None)
            empty = True
            for batch in it:
                empty = False
                yield batch
            if empty and self.batch_in_epoch == 0:
                raise RuntimeError(f"task.train_batches({self.epoch}) yielded no batches")
            self.epoch += 1
            self.batch_in_epoch = 0
            self._positioned = False

    def _step_flags(self, has_batch: bool) -> tuple[bool, int]:
        """Whether some process has run out of batches, and the stop signal (0: none), as
        every process sees them: one all-reduce (max) of two integers per step when there
        are several processes, nothing but two reads alone.

        Without this agreement a process that runs out of batches (uneven data) would leave
        the loop while the others wait for it in the step's collectives forever; a signal
        seen by one process only would stop it alone.

        Args:
            has_batch: whether this process fetched a batch for the step.
        """
        signum = self._stop.signum if self._stop is not None else 0
        if not is_distributed():
            return not has_batch, signum
        buf = torch.tensor([0 if has_batch else 1, signum], dtype=torch.int64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return bool(buf[0]), int(buf[1])

    def _report_uneven(self, has_batch: bool, batches: Iterator[Any]) -> None:
        """Log (rank 0) that the processes ran out of batches unevenly and how many each
        leaves unused (collective). The rest of this process's batches is read to count
        them, which also moves the data position to the end as on the others.

        Args:
            has_batch: whether this process still had a batch for the step.
            batches: this process's batch iterator (finite: an epoch-bounded run).
        """
        unused = 0
        if has_batch:
            # max_steps > 0 wraps into new epochs for ever and no process runs out
            unused = 1 + (sum(1 for _ in batches) if self.config.max_steps == 0 else 0)
        counts = torch.zeros(world_size(), dtype=torch.int64, device=self.device)
        counts[process_rank()] = unused
        dist.all_reduce(counts)
        if process_rank() == 0:
            left = {r: int(n) for r, n in enumerate(counts.tolist()) if n}
            empty = [r for r, n in enumerate(counts.tolist()) if not n]
            logger.warning(
                "ranks ran out of batches unevenly at step %d: rank(s) %s had none left; %s; all ranks stop "
                "here together",
                self.step,
                ", ".join(map(str, empty)),
                ", ".join(f"rank {r} leaves {n} batch(es) unused" for r, n in left.items()),
            )

    def _stop_on_signal(self, signum: int) -> None:
        """Checkpoint (unless this step's is written) and raise :class:`TrainingStopped`
        (collective: every process calls it at the same step)."""
        path: Optional[Path] = None
        note = ""
        self.wait_for_checkpoint()
        if self._saved is not None and self._saved[0] == self.step:
            path = self._saved[1]
        else:
            try:
                path = self.save()
            except NonFiniteStateError as e:
                note = f" (none written: {e})"
        message = f"stopped by {signal_name(signum)} at step {self.step}; checkpoint {path}{note}; resume with --resume"
        if process_rank() == 0:
            logger.warning(message)
        raise TrainingStopped(signum, self.step, path, message)

    def _reduce_loss(self, loss: torch.Tensor) -> tuple[float, bool]:
        """Global mean of the loss and whether it is finite on every process."""
        value = loss.detach().float().reshape(())
        finite = bool(torch.isfinite(value))
        if not is_distributed():
            return float(value), finite
        buf = torch.stack(
            [value if finite else torch.zeros_like(value), torch.tensor(0.0 if finite else 1.0, device=value.device)]
        ).to(self.device)
        dist.all_reduce(buf)
        return float(buf[0]) / world_size(), float(buf[1]) == 0.0

    def _grads_finite(self) -> bool:
        """Whether every gradient is finite on every process (collective)."""
        flags = []
        for p in self.model.parameters():
            g = p.grad
            if g is not None:
                flags.append(torch.isfinite(g.coalesce().values() if g.is_sparse else g).all())
        finite = bool(torch.stack(flags).all()) if flags else True
        if not is_distributed():
            return finite
        buf = torch.tensor(0.0 if finite else 1.0, device=self.device)
        dist.all_reduce(buf)
        return float(buf) == 0.0

    def _skip_nonfinite(self, what: str) -> None:
        """Count a skipped batch; stop (after checkpointing the last good state) per the policy."""
        cfg = self.config
        self._zero_grad()
        self.nonfinite += 1
        self.step += 1
        if not cfg.skip_nonfinite:
            self._stop_nonfinite(f"non-finite {what} at step {self.step}")
        if self.nonfinite > cfg.max_nonfinite:
            self._stop_nonfinite(
                f"{self.nonfinite} non-finite batches exceed max_nonfinite={cfg.max_nonfinite} "
                f"(the last one: non-finite {what} at step {self.step})"
            )

    def _stop_nonfinite(self, message: str) -> None:
        """Raise FloatingPointError; checkpoint first when checkpoints are on (collective)."""
        if self.config.checkpoint_at_end or self.config.checkpoint_every:
            try:
                path = self.save()
                message += f"; the last good state is saved in {path}"
            except NonFiniteStateError as e:
                message += f"; no checkpoint written: {e}"
        raise FloatingPointError(message)
