"""The trainer's CUDA graphs: the checks before a graphed run, the capture of the two
graphed parts of a step and the fallback to eager steps (:class:`TrainerGraphs`, a mixin of
:class:`~comera_rec.training.engine.Trainer`; the capture itself is
:mod:`comera_rec.training.cuda_graph`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from comera_rec.rank.schedule import RankSchedule
from comera_rec.tensor.embedding import set_static_shapes
from comera_rec.training.cuda_graph import CaptureBackend, CudaGraphCapture, StepGraphs, capturable_objective
from comera_rec.training.dist import is_distributed, world_size
from comera_rec.training.optim import OptimConfig
from comera_rec.training.step import captured_update
from comera_rec.training.trainer_config import Task, TrainerConfig

# the Trainer's records keep the engine's logger name
logger = logging.getLogger("comera_rec.training.engine")


def eager_cuda_hint(device: torch.device, cuda_graphs: bool, processes: int) -> Optional[str]:
    """The log line for a run on one GPU without CUDA graphs, else ``None``.

    Eagerly, each step's TT lookups size their de-duplicated work on the host, so the step
    waits on the host: on an H200 the compressed DLRM step took 22-25 ms eagerly against
    3.8 ms as one graph, and the trainer's graphed loop trained the demo config 3.1x faster
    (docs/gpu.md, "Fourth run" and "Fifth run").

    Args:
        device: the run's device.
        cuda_graphs: ``TrainerConfig.cuda_graphs``.
        processes: the run's process count (graphs are for one process only).

    Example::

        >>> eager_cuda_hint(torch.device("cpu"), False, 1) is None
        True
    """
    if device.type != "cuda" or cuda_graphs or processes > 1:
        return None
    return (
        f"training on {device} eagerly: the TT lookups size their work on the host every step, "
        "so the step is bound by the host; trainer.cuda_graphs=true captures the step as CUDA "
        "graphs (3.1x the samples/s on the DLRM demo on an H200, docs/gpu.md)"
    )


class TrainerGraphs:
    """Mixin of :class:`~comera_rec.training.engine.Trainer`: its CUDA-graph methods.

    It relies on these attributes of the trainer: ``config``, ``optim_config``, ``task``,
    ``device``, ``schedule``, ``step``, ``model``, ``wrapped``, ``optimizers``,
    ``_graph_capture`` (the capture backend, None for CUDA's); it sets ``_graphs`` (the
    :class:`~comera_rec.training.cuda_graph.StepGraphs`, None when eager) and ``_capturable``
    (whether the optimisers are built capturable); and it calls the trainer's :meth:`_zero_grad`.
    """

    config: TrainerConfig
    optim_config: OptimConfig
    task: Task
    device: torch.device
    schedule: RankSchedule
    step: int
    model: Optional[nn.Module]
    wrapped: Optional[nn.Module]
    optimizers: list[Any]
    _graph_capture: Optional[CaptureBackend]
    _graphs: Optional[StepGraphs]
    _capturable: bool
    _zero_grad: Callable[[], None]

    def _check_cuda_graphs(self) -> None:
        """Refuse ``cuda_graphs`` where it cannot run; decide on capturable optimisers."""
        oc = self.optim_config
        if self._graph_capture is None and self.device.type != "cuda":
            raise ValueError(
                f"TrainerConfig.cuda_graphs=True needs a CUDA device, but the device is {self.device} "
                f"(trainer.device={self.config.device!r}); CUDA graphs do not exist on CPU: set cuda_graphs=false"
            )
        if is_distributed():
            raise ValueError(
                "TrainerConfig.cuda_graphs=True supports one process only (collectives inside a "
                f"captured backward are not handled); this run has {world_size()} processes"
            )
        scheduled = getattr(oc, "warmup_steps", 0) or getattr(oc, "decay", "none") != "none"
        if self.device.type == "cuda" and scheduled and oc.name not in ("Adam", "AdamW"):
            raise ValueError(
                f"TrainerConfig.cuda_graphs=True with a learning-rate schedule needs Adam or AdamW "
                f"(their rate can be a device tensor); {oc.name} would bake each step's rate into "
                f"the graph"
            )
        self._capturable = self.device.type == "cuda"

    def _start_graphs(self) -> None:
        set_static_shapes(self.model, True)  # capturable lookups; id validation off
        capture = self._graph_capture if self._graph_capture is not None else CudaGraphCapture(self.device)
        self._graphs = StepGraphs(self._graph_forward_backward, self._graph_update, capture=capture)

    def _graphs_usable(self) -> bool:
        """Whether this step runs as graphs. The late rank stage picks its term on the host
        every step: from its start on, the graphs are dropped and steps run eagerly."""
        if self.schedule.capturable(self.step, self.model):
            return True
        assert self._graphs is not None
        self._graphs.invalidate()
        self._graphs = None
        self._zero_grad()
        logger.warning("cuda_graphs: the %s rank stage is not capturable; training on eagerly", self.schedule.stage)
        return False

    def _graph_forward_backward(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """Captured part 1: zero the gradients, forward, objective, backward (static outputs)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        loss, _, labels = self.task.step_loss(self.wrapped, batch)
        objective, surrogate = capturable_objective(self.schedule, self.model, loss)
        objective.backward()
        return loss.detach(), labels.detach(), objective.detach(), surrogate.detach()

    def _graph_update(self) -> None:
        """Captured part 2: the clip and the optimiser steps (the rates are set on the host
        before each replay, see :class:`~comera_rec.training.step.GraphedStep`)."""
        captured_update(self.model, self.optimizers, self.optim_config)
