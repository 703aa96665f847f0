"""The engine's step as captured graphs: :func:`capturable_objective` (the rank schedule's
objective without host syncs) and :class:`StepGraphs` (forward + backward, then the update)
(re-exported by :mod:`comera_rec.training.cuda_graph`)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from comera_rec.training.graph_capture import CaptureBackend, EagerCapture, GraphedTrainStep  # noqa: F401 (examples)

# the name it had before the split out of cuda_graph.py: log filters and captures keep working
logger = logging.getLogger("comera_rec.training.cuda_graph")


def capturable_objective(schedule: Any, model: nn.Module, task_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank schedule's objective without host synchronisation: ``(loss, S^)``.

    Equal to ``schedule.objective(model, task_loss, step).loss`` in the early stage
    (``L + gamma * S^ + beta * ||G||^2``) and without a schedule (``L``), with the
    live-rank count of the mean surrogate kept on the device instead of read into an
    int. The late stage chooses its term on the host every step from the global loss
    and the size, so it is not capturable: a ``ValueError`` here, and the engine runs
    the late stage eagerly.

    Args:
        schedule: a :class:`~comera_rec.rank.schedule.RankSchedule`.
        model: the unwrapped model.
        task_loss: the scalar task loss.

    Returns:
        The objective and the surrogate ``S^`` (zero without a schedule), scalars.

    Example::

        >>> from comera_rec.rank.schedule import RankSchedule, RankScheduleConfig
        >>> from comera_rec.tensor import TTLinear
        >>> model, sched = TTLinear(16, 8, rank=4), RankSchedule(RankScheduleConfig(mode="threshold", gamma=0.5))
        >>> loss = model(torch.randn(2, 16)).pow(2).mean()
        >>> graphed, _ = capturable_objective(sched, model, loss)
        >>> torch.allclose(graphed, sched.objective(model, loss, 0).loss)
        True
    """
    c = schedule.config
    if not c.enabled:
        return task_loss, task_loss.new_zeros(())
    if c.mode == "budget":  # the budget schedule steers the size by cuts: the objective is L
        return task_loss, task_loss.new_zeros(())
    if schedule.stage != "early":
        raise ValueError(
            f"capturable_objective: the {schedule.stage!r} stage decides on the host each step; "
            f"only the early stage can be captured"
        )
    # the schedule's own early objective, its live-entry count kept a device tensor
    return schedule.early_objective(model, task_loss, on_device=True)


def takes_tensor_lr(optimizer: Any) -> bool:
    """Capturable torch optimisers (Adam, AdamW built with ``capturable=True``) read a tensor ``lr``."""
    return isinstance(optimizer, torch.optim.Optimizer) and bool(optimizer.defaults.get("capturable", False))


class StepGraphs:
    """The engine's training step as two captured graphs, host checks between them.

    1. :attr:`forward_backward` (a :class:`GraphedTrainStep` over the batch): zero the
       gradients, forward, objective, backward; returns static tensors (the loss ...).
    2. :meth:`update`: a :class:`GraphedTrainStep` without inputs running gradient
       clipping and the optimiser steps.

    Between them the engine reads the loss, skips non-finite batches and checks the
    gradients as it does eagerly; the split keeps those semantics (a skipped batch never
    reaches the optimiser). Once :attr:`forward_backward` is captured the gradients
    live at fixed addresses: they must not be set to ``None`` (the engine's
    ``_zero_grad`` leaves them while :attr:`holds_grads`); the graph zeroes them.

    Learning rates: for capturable optimisers each param group's ``lr`` is a device
    tensor during the update (filled from the group's float ``lr`` before every call,
    so schedules that assign floats keep working and checkpoints hold floats). Other
    optimisers' rates are numbers baked into the graph: when one changes, the update
    graph is captured again (after its warm-up).

    Args:
        forward_backward: ``static_batch -> outputs``.
        update: ``() -> None``, the clip and the optimiser steps.
        capture: the capture backend shared by both graphs.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def fb(b):
        ...     loss = model(b).sum()
        ...     loss.backward()
        ...     return loss.detach()
        >>> graphs = StepGraphs(fb, lambda: opt.step(), capture=EagerCapture())
        >>> for _ in range(3):
        ...     loss = graphs.forward_backward(torch.ones(4, 2)); graphs.update([opt])
        >>> graphs.forward_backward.captures, graphs.update_step.captures
        (1, 1)
    """

    def __init__(
        self,
        forward_backward: Callable[[Any], Any],
        update: Callable[[], None],
        *,
        capture: CaptureBackend,
    ) -> None:
        self.capture = capture
        self.forward_backward = GraphedTrainStep(forward_backward, capture=capture, name="forward_backward")
        self.update_step = GraphedTrainStep(self._run_update, capture=capture, name="update")
        self._update = update
        self._optimizers: list[Any] = []
        self._lr_tensors: dict[tuple[int, int], torch.Tensor] = {}
        self._baked: Optional[list[Any]] = None

    @property
    def holds_grads(self) -> bool:
        """Whether a captured backward writes the parameters' gradients in place."""
        return self.forward_backward.is_captured

    def invalidate(self) -> None:
        """Drop both graphs (after a truncation or a new optimiser): both are captured again."""
        self.forward_backward.invalidate()
        self.update_step.invalidate()
        self._lr_tensors.clear()
        self._baked = None

    def _prepare_learning_rates(self) -> list[Any]:
        """Fill the lr tensors from the float rates; return the rates baked in as numbers."""
        baked: list[Any] = []
        for i, opt in enumerate(self._optimizers):
            tensor_lr = takes_tensor_lr(opt)
            for j, group in enumerate(getattr(opt, "param_groups", ())):
                lr = group.get("lr")
                if not tensor_lr or isinstance(lr, torch.Tensor):
                    baked.append(lr if not isinstance(lr, torch.Tensor) else id(lr))
                    continue
                t = self._lr_tensors.get((i, j))
                if t is None:  # made eagerly (never inside a capture); lives as long as the graph
                    p = group["params"][0]
                    t = torch.tensor(
                        float(lr), dtype=torch.float64 if p.dtype == torch.float64 else torch.float32, device=p.device
                    )
                    self._lr_tensors[(i, j)] = t
                else:
                    t.fill_(float(lr))  # an async fill: no synchronisation
        return baked

    @contextlib.contextmanager
    def _tensor_learning_rates(self) -> Iterator[None]:
        saved: list[tuple[dict[str, Any], Any]] = []
        try:
            for (i, j), t in self._lr_tensors.items():
                group = self._optimizers[i].param_groups[j]
                saved.append((group, group["lr"]))
                group["lr"] = t
            yield
        finally:
            for group, lr in saved:
                group["lr"] = lr

    def _run_update(self, _: Any) -> None:
        with self._tensor_learning_rates():
            self._update()

    def update(self, optimizers: Sequence[Any]) -> None:
        """Run (warm up, capture or replay) the update for ``optimizers`` (the engine's, every step)."""
        if [id(o) for o in optimizers] != [id(o) for o in self._optimizers]:
            if self._optimizers:  # new optimiser objects: the graph holds the old ones' state
                self.update_step.invalidate()
                self._baked = None
            self._lr_tensors.clear()
            self._optimizers = list(optimizers)
        baked = self._prepare_learning_rates()
        if self.update_step.is_captured and baked != self._baked:
            logger.info("a learning rate baked into the update graph changed: capturing it again")
            self.update_step.invalidate()
        before = self.update_step.captures
        self.update_step(())
        if self.update_step.captures != before:
            self._baked = baked
