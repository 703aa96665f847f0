"""One training step behind one interface, run eagerly or replayed from CUDA graphs.

The trainer's loop is the same for both (:meth:`~comera_rec.training.engine.Trainer._train_step`)::

    loss, labels = step.forward(batch)               # eager: forward; graphed: replay forward + backward
    global_loss, finite = trainer._reduce_loss(loss) # the loop's own checks between the parts
    terms = step.backward(loss, global_loss)          # eager: objective + backward; graphed: read back
    step.update(total)                                # rates set, gradients clipped, optimisers stepped

Clipping and the learning-rate schedule are written once, in :func:`clip_gradients` and
:func:`schedule_learning_rates`; the eager step calls both, the graphed step sets the rates
on the host and replays the clip and the optimiser steps it captured with
:func:`clip_gradients`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Protocol, Sequence

import torch
from torch import nn

from comera_rec.rank.schedule import ObjectiveTerms
from comera_rec.training.optim import OptimConfig, lr_factor, set_lr_factor
from comera_rec.training.trainer_config import AUTOCAST_DTYPES, task_hook
from comera_rec.utils.isa import cpu_bfloat16_products


def forward_precision(device: torch.device, autocast: str) -> contextlib.AbstractContextManager:
    """Where a forward runs: under ``torch.autocast`` on ``device``'s type in the dtype that
    ``autocast`` (``TrainerConfig.autocast``) names, or as it is (``"none"``). The backward
    belongs outside it, as torch advises.

    Args:
        device: the model's device.
        autocast: a key of :data:`~comera_rec.training.trainer_config.AUTOCAST_DTYPES`.

    Example::

        >>> with forward_precision(torch.device("cpu"), "bfloat16"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
        >>> with forward_precision(torch.device("cpu"), "none"):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    dtype = AUTOCAST_DTYPES[autocast]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def check_forward_precision(device: torch.device, autocast: str) -> None:
    """Refuse a forward precision that would run far slower than float32 on ``device``:
    ``"bfloat16"`` on a CPU for which torch has no bfloat16 matrix kernels
    (:func:`~comera_rec.utils.isa.cpu_bfloat16_products`). Autocast is a speed option, and
    there its products fall to a reference loop: on an AVX2 EPYC (Zen 3) the dense demo
    trained 21x slower (1.5k against 30.7k samples/s), the compressed one 0.85x
    (docs/training.md).

    Args:
        device: the model's device.
        autocast: a key of :data:`~comera_rec.training.trainer_config.AUTOCAST_DTYPES`.

    Raises:
        ValueError: naming ``trainer.autocast`` and the CPU's lack.

    Example::

        >>> check_forward_precision(torch.device("cpu"), "none")  # float32 runs anywhere
    """
    if autocast == "none" or device.type != "cpu" or cpu_bfloat16_products():
        return
    raise ValueError(
        f"trainer.autocast={autocast!r} on a CPU for which torch has no bfloat16 matrix kernels "
        f"(oneDNN's need AVX-512 or AVX2-VNNI-2 on x86, BF16 on Arm; this CPU's code is "
        f"{torch.backends.cpu.get_cpu_capability()}): every bfloat16 product would run in a reference loop, "
        f"about 170x slower than in float32 (the dense demo trained 21x slower on such a CPU). "
        f"Set trainer.autocast=none"
    )


def clip_gradients(model: nn.Module, max_norm: float) -> None:
    """Clip the global gradient norm of ``model``'s parameters to ``max_norm`` (0: no clip).

    Gradients are already all-reduced when this runs, so every process clips alike.

    Args:
        model: the unwrapped model.
        max_norm: the largest norm kept (``OptimConfig.clip_grad_norm``).
    """
    if max_norm > 0:
        grads = [p for p in model.parameters() if p.grad is not None]
        if grads:
            torch.nn.utils.clip_grad_norm_(grads, max_norm)


def schedule_learning_rates(
    optimizers: Sequence[Any], config: OptimConfig, step: int, total_steps: Optional[int]
) -> None:
    """Set this step's learning rates (warm-up and decay of ``config``) on every optimiser.

    Args:
        optimizers: the optimisers (each param group keeps its base rate).
        config: the warm-up and decay settings.
        step: optimiser steps taken.
        total_steps: the run's length (None: no decay).
    """
    if config.warmup_steps or config.decay != "none":
        set_lr_factor(optimizers, lr_factor(config, step, total_steps))


class Step(Protocol):
    """A training step in three parts (see the module docstring)."""

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The task loss (a scalar) and the labels of ``batch``."""
        ...

    def backward(self, loss: torch.Tensor, global_loss: float) -> ObjectiveTerms:
        """The objective's terms, its gradients in place."""
        ...

    def update(self, total_steps: Optional[int]) -> None:
        """Learning rates, clip and optimiser steps."""
        ...


class EagerStep:
    """The step run op by op.

    Args:
        trainer: the :class:`~comera_rec.training.engine.Trainer` (its task, wrapped and
            unwrapped model, schedule, optimisers, optimiser config and step counter are
            read at each call, so a rebuild after truncation needs no new step object).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.trainer
        with forward_precision(t.device, t.config.autocast):
            loss, _, labels = t.task.step_loss(t.wrapped, batch)
        return loss, labels

    def backward(self, loss: torch.Tensor, global_loss: float) -> ObjectiveTerms:
        t = self.trainer
        terms = t.schedule.objective(t.model, loss, t.step, global_task_loss=global_loss)
        terms.loss.backward()
        return terms

    def update(self, total_steps: Optional[int]) -> None:
        t = self.trainer
        clip_gradients(t.model, t.optim_config.clip_grad_norm)
        schedule_learning_rates(t.optimizers, t.optim_config, t.step, total_steps)
        for opt in t.optimizers:
            opt.step()


class GraphedStep:
    """The step replayed from the trainer's captured graphs
    (:class:`~comera_rec.training.cuda_graph.StepGraphs`): forward, objective and backward
    in one, the clip and the optimiser steps in the other.

    Args:
        trainer: the trainer; its ``_graphs`` hold the captures.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._objective: Optional[torch.Tensor] = None
        self._surrogate: Optional[torch.Tensor] = None

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        task_hook(self.trainer.task, "check_batch")(batch)  # on the host: the replay checks nothing
        loss, labels, self._objective, self._surrogate = self.trainer._graphs.forward_backward(batch)
        return loss, labels

    def backward(self, loss: torch.Tensor, global_loss: float) -> ObjectiveTerms:
        # already run by the replay; the size S is not read by the loop, so not computed
        # (it would cost a host synchronisation per module)
        assert self._objective is not None and self._surrogate is not None, "forward() first"
        return ObjectiveTerms(self._objective, float(loss), float(self._surrogate), 0, self.trainer.schedule.stage)

    def update(self, total_steps: Optional[int]) -> None:
        t = self.trainer
        schedule_learning_rates(t.optimizers, t.optim_config, t.step, total_steps)  # on the host
        t._graphs.update(t.optimizers)  # replays clip_gradients and the optimiser steps


def captured_update(model: nn.Module, optimizers: Sequence[Any], config: OptimConfig) -> None:
    """What :class:`GraphedStep` captures as its second graph: the clip and the optimiser
    steps (the rates are set on the host before each replay).

    Args:
        model: the unwrapped model.
        optimizers: the optimisers to step.
        config: the optimiser settings (its ``clip_grad_norm``).
    """
    clip_gradients(model, getattr(config, "clip_grad_norm", 0.0))
    for opt in optimizers:
        opt.step()
