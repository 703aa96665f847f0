"""Capture backends (CUDA graphs, and an eager stand-in for tests) and :class:`GraphedTrainStep`,
which warms up, captures and replays a step on static buffers (re-exported by
:mod:`comera_rec.training.cuda_graph`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Protocol

import torch

from comera_rec.training.graph_buffers import copy_into, copy_outputs, detach_tree, make_static
from comera_rec.training.host_sync import forbid_host_syncs

CUDA_WARMUP_STEPS = 3  # eager steps on a side stream before a capture (PyTorch's docs use 3)


class CaptureError(RuntimeError):
    """Capturing the step failed; the message lists the usual causes."""

    __module__ = "comera_rec.training.cuda_graph"  # its public home (re-exported there): tracebacks and pickles name it


class Captured(Protocol):
    """A captured step: :meth:`replay` runs it; :attr:`outputs` are its static outputs."""

    outputs: Any

    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    """How a :class:`GraphedTrainStep` warms up and captures (injectable for tests)."""

    device: torch.device
    warmup_steps: int

    def run_eager(self, fn: Callable[[Any], Any], inputs: Any) -> Any:
        """Run ``fn(inputs)`` now (a warm-up step, a real training step)."""
        ...

    def capture(self, fn: Callable[[Any], Any], inputs: Any) -> Captured:
        """Record ``fn(inputs)`` without running it; the caller replays it next."""
        ...


class CudaCaptured:
    """A step captured in a CUDA graph, and its static outputs."""

    def __init__(self, graph: Any, outputs: Any) -> None:
        self.graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapture:
    """Capture with ``torch.cuda.graph``; warm-up steps run on a side stream.

    Each capture gets its own private memory pool (graphs replayed in a different order
    from their capture must not share one). Never run: no GPU was available.

    Args:
        device: the CUDA device (``"cuda"``: the current one).
        warmup_steps: eager steps before each capture (lazy initialisation: optimiser
            state, cuBLAS workspaces, Triton compilation, must not happen in a capture).

    Example::

        >>> backend = CudaGraphCapture("cuda")  # doctest: +SKIP
    """

    def __init__(self, device: torch.device | str = "cuda", warmup_steps: int = CUDA_WARMUP_STEPS) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaGraphCapture: CUDA graphs need a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.warmup_steps = int(warmup_steps)
        self._side: Optional[torch.cuda.Stream] = None

    def run_eager(self, fn: Callable[[Any], Any], inputs: Any) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)  # the inputs were copied on the current stream
        with torch.cuda.stream(self._side):
            out = fn(inputs)
        current.wait_stream(self._side)
        return out

    def capture(self, fn: Callable[[Any], Any], inputs: Any) -> Captured:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn(inputs)
        return CudaCaptured(graph, outputs)


class EagerRecorded:
    """A step "captured" by :class:`EagerCapture`: each replay runs it eagerly on the static inputs."""

    def __init__(self, backend: "EagerCapture", fn: Callable[[Any], Any], inputs: Any) -> None:
        self.backend = backend
        self.fn = fn
        self.inputs = inputs
        self.outputs: Any = None

    def replay(self) -> None:
        self.backend.log.append("replay")
        check = forbid_host_syncs() if self.backend.check_syncs else contextlib.nullcontext()
        with check:
            out = self.fn(self.inputs)
        if self.outputs is None:
            self.outputs = detach_tree(out)
        else:  # like a graph: the same output tensors, overwritten by every replay
            copy_outputs(self.outputs, out)


class EagerCapture:
    """A capture backend that runs everything eagerly: for tests, on any device.

    ``capture`` only remembers the function and its (static) inputs; each ``replay``
    runs it on them, and the outputs of the first replay are the static outputs that
    later replays copy into, as a graph's would be. ``log`` records every call
    ("eager", "capture", "replay").

    Args:
        device: where the static buffers live.
        warmup_steps: eager steps before each capture.
        check_syncs: run replays under :func:`forbid_host_syncs`.

    Example::

        >>> backend = EagerCapture(warmup_steps=1)
        >>> step = GraphedTrainStep(lambda b: b * 2, capture=backend)
        >>> [step(torch.tensor(float(i))).item() for i in range(3)], backend.log
        ([0.0, 2.0, 4.0], ['eager', 'capture', 'replay', 'replay'])
    """

    def __init__(self, device: torch.device | str = "cpu", warmup_steps: int = 1, check_syncs: bool = False) -> None:
        self.device = torch.device(device)
        self.warmup_steps = int(warmup_steps)
        self.check_syncs = check_syncs
        self.log: list[str] = []

    def run_eager(self, fn: Callable[[Any], Any], inputs: Any) -> Any:
        self.log.append("eager")
        return fn(inputs)

    def capture(self, fn: Callable[[Any], Any], inputs: Any) -> Captured:
        self.log.append("capture")
        return EagerRecorded(self, fn, inputs)


# ---------------------------------------------------------------------------- the graphed step


class GraphedTrainStep:
    """A training step run as a captured graph on static input buffers.

    ``fn(static_batch)`` does the whole step (forward, backward, optimiser step) and
    returns tensors (a pytree). Each call copies the batch into the static buffers
    (made from the first batch; shapes and dtypes are checked, see :func:`copy_into`);
    the first ``warmup_steps`` calls after a (re)start run ``fn`` eagerly (on a side
    stream on CUDA; they are real steps), the next one captures and every call
    replays. A replay returns the static outputs, overwritten by the next replay: read
    or clone them before calling again.

    :meth:`invalidate` drops the graph and the buffers: the next call starts over with
    warm-up and a new capture. Call it whenever what the graph captured changes:
    parameter shapes (a rank truncation), the optimiser object or its state tensors,
    a hyper-parameter passed as a number (a learning rate), the batch layout.

    Args:
        fn: the step, ``static_batch -> outputs``; it must not synchronise with the host.
        device: where to capture (a :class:`CudaGraphCapture` is made); ignored with ``capture``.
        capture: the capture backend (default: CUDA graphs on ``device``).
        warmup_steps: eager calls before each capture (default: the backend's).
        name: what to call the step in errors.

    Example::

        >>> backend = EagerCapture(warmup_steps=0)
        >>> step = GraphedTrainStep(lambda b: b["x"].sum(), capture=backend)
        >>> step({"x": torch.ones(3)}).item(), step({"x": torch.zeros(3)}).item()
        (3.0, 0.0)
        >>> step.invalidate(); step({"x": torch.ones(5)}).item(), step.captures
        (5.0, 2)
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        device: torch.device | str | None = None,
        capture: Optional[CaptureBackend] = None,
        warmup_steps: Optional[int] = None,
        name: str = "step",
    ) -> None:
        if capture is None:
            capture = CudaGraphCapture(device if device is not None else "cuda")
        self.fn = fn
        self.backend = capture
        self.warmup_steps = capture.warmup_steps if warmup_steps is None else int(warmup_steps)
        if self.warmup_steps < 0:
            raise ValueError(f"GraphedTrainStep: warmup_steps must be >= 0, got {warmup_steps}")
        self.name = name
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0
        self._static: Any = None
        self._graph: Optional[Captured] = None
        self._warmed = 0

    @property
    def is_captured(self) -> bool:
        """Whether a graph is held (the next call replays it)."""
        return self._graph is not None

    @property
    def static_inputs(self) -> Any:
        """The static batch (``None`` before the first call and after :meth:`invalidate`)."""
        return self._static

    def invalidate(self) -> None:
        """Drop the graph, its memory and the static buffers; the next call warms up and captures again."""
        self._graph = None
        self._static = None
        self._warmed = 0

    def __call__(self, batch: Any) -> Any:
        if self._static is None:
            self._static = make_static(batch, self.backend.device)
        else:
            copy_into(self._static, batch)
        if self._graph is None:
            if self._warmed < self.warmup_steps:
                self._warmed += 1
                self.eager_runs += 1
                return self.backend.run_eager(self.fn, self._static)
            try:
                self._graph = self.backend.capture(self.fn, self._static)
            except Exception as e:
                raise CaptureError(
                    f"{self.name}: capturing the step failed ({type(e).__name__}: {e}). Usual causes: a host "
                    f"synchronisation in the step (.item(), bool() or print of a tensor, input validation: "
                    f"turn it off), a data-dependent shape (torch.unique, nonzero, boolean indexing; use "
                    f"static-shape lookups), a CPU tensor copied to the GPU inside the step, or work the "
                    f"warm-up did not do (lazy initialisation, compilation)"
                ) from e
            self.captures += 1
        self._graph.replay()
        self.replays += 1
        return self._graph.outputs
