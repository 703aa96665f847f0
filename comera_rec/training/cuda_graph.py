"""CUDA-graph capture of the training step, and what makes it testable without a GPU.

A captured step replays every kernel of forward, backward and optimiser step with one
launch, on fixed addresses: the inputs are copied into *static* buffers first, and
the outputs are static tensors overwritten by the next replay. Nothing in the step
may synchronise with the host or make a shape from data (see docs/gpu.md, "CUDA graphs").

Pieces:

* :func:`make_static` / :func:`copy_into`: static input buffers for a batch (a pytree of
  tensors, dicts, lists, tuples, dataclasses such as TorchRec's ``Batch``, and
  ``KeyedJaggedTensor``), and the per-step copy, which checks every shape and dtype and
  names the field that differs.
* :class:`GraphedTrainStep`: warm up eagerly, capture, replay; :meth:`~GraphedTrainStep.invalidate`
  forces a new capture (after a truncation changed parameter shapes, or a new optimiser).
* Capture backends: :class:`CudaGraphCapture` (``torch.cuda.graph``, side-stream
  warm-up) and :class:`EagerCapture`, which "captures" by remembering the function and
  "replays" by running it eagerly, so that the rest runs, and is tested, on a CPU.
* :class:`StepGraphs`: the engine's step as two graphs (forward + objective + backward;
  clip + optimiser steps) with the engine's host checks between them, learning rates
  of capturable optimisers held in device tensors.
* :func:`capturable_objective`: the rank schedule's early-stage objective with the
  live-rank count kept on the device.
* :func:`forbid_host_syncs`: raises on operations that synchronise with the host or
  have data-dependent shapes, as far as the dispatched operators show it on a CPU;
  :func:`capturing` says whether code runs inside a capture (or that check).

Status: the CUDA backend ran on an H200 (docs/gpu.md); everything is also tested on CPU
with the eager stand-in (``tests/training/test_cuda_graph.py``).

Example::

    >>> model = torch.nn.Linear(3, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(batch):
    ...     loss = (model(batch["x"]).squeeze(1) - batch["y"]).pow(2).mean()
    ...     loss.backward()
    ...     opt.step()
    ...     opt.zero_grad()
    ...     return loss.detach()
    >>> graphed = GraphedTrainStep(step, capture=EagerCapture())  # CUDA: device="cuda"
    >>> for _ in range(3):
    ...     loss = graphed({"x": torch.randn(4, 3), "y": torch.randn(4)})
    >>> graphed.captures, graphed.replays
    (1, 2)
"""

from __future__ import annotations

# The pieces live in graph_buffers, host_sync, graph_capture and step_graphs; every name
# (the helpers too, under their public names) stays importable from here.
import torch  # noqa: F401 (the example above)

from comera_rec.training.graph_buffers import (  # noqa: F401
    PLAIN_TYPES,
    BatchLayoutError,
    copy_into,
    copy_outputs,
    copy_tensor,
    detach_tree,
    init_fields,
    is_dataclass_instance,
    kjt_type,
    make_static,
    make_static_at,
    static_tensor,
)
from comera_rec.training.graph_capture import (  # noqa: F401
    CUDA_WARMUP_STEPS,
    CaptureBackend,
    Captured,
    CaptureError,
    CudaCaptured,
    CudaGraphCapture,
    EagerCapture,
    EagerRecorded,
    GraphedTrainStep,
)
from comera_rec.training.host_sync import SYNC_OPS, ForbidHostSyncs, HostSyncError, capturing, forbid_host_syncs  # noqa: F401
from comera_rec.training.step_graphs import StepGraphs, capturable_objective, logger, takes_tensor_lr  # noqa: F401

__all__ = [
    "BatchLayoutError",
    "CaptureBackend",
    "CaptureError",
    "CudaGraphCapture",
    "EagerCapture",
    "GraphedTrainStep",
    "HostSyncError",
    "StepGraphs",
    "capturable_objective",
    "capturing",
    "copy_into",
    "forbid_host_syncs",
    "make_static",
]
