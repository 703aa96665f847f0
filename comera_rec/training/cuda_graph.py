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
  have data-dependent shapes, as far as the dispatched operators show it on a CPU.

Status: the CUDA backend has never run (no GPU was available); everything else is
tested on CPU (``tests/training/test_cuda_graph.py``).

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

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

CUDA_WARMUP_STEPS = 3  # eager steps on a side stream before a capture (PyTorch's docs use 3)


class BatchLayoutError(ValueError):
    """A batch does not fit the static buffers of a captured step (the message names the field)."""


class CaptureError(RuntimeError):
    """Capturing the step failed; the message lists the usual causes."""


class HostSyncError(RuntimeError):
    """An operation that synchronises with the host ran where :func:`forbid_host_syncs` forbids it."""


# ---------------------------------------------------------------------------- static buffers


@functools.lru_cache(maxsize=None)
def _kjt_type() -> Optional[type]:
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:  # torchrec is a dependency, but keep the graph code importable without it
        return None
    return KeyedJaggedTensor


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _static_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)  # contiguous, owned by the step
    out.copy_(t.detach())
    return out


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _init_fields(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if f.init]


def make_static(batch: Any, device: torch.device | str) -> Any:
    """A copy of ``batch`` whose tensors are new buffers on ``device``, to capture against.

    Supported: tensors, ``KeyedJaggedTensor`` (values, lengths, offsets and weights
    become buffers; keys, stride, ``length_per_key`` and ``offset_per_key`` are fixed,
    computed now if the KJT has not cached them), dicts, lists, tuples (named ones
    too), dataclasses (their init fields), and plain values (None, bool, int, float,
    str), which are kept and must not change.

    Args:
        batch: the first batch.
        device: where the buffers live (the capture's device).

    Returns:
        The static batch, same structure.

    Raises:
        BatchLayoutError: an unsupported type or a variable-stride KJT (names the field).

    Example::

        >>> static = make_static({"x": torch.ones(2), "n": 3}, "cpu")
        >>> static["x"], static["n"]
        (tensor([1., 1.]), 3)
    """
    return _static(batch, torch.device(device), "batch")


def _static(obj: Any, device: torch.device, path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return _static_tensor(obj, device)
    kjt = _kjt_type()
    if kjt is not None and isinstance(obj, kjt):
        if obj.variable_stride_per_key():
            raise BatchLayoutError(
                f"{path}: KeyedJaggedTensor with variable batch sizes per feature cannot be captured"
            )
        weights = obj.weights_or_none()
        return kjt(
            keys=list(obj.keys()),
            values=_static_tensor(obj.values(), device),
            lengths=_static_tensor(obj.lengths(), device),
            offsets=_static_tensor(obj.offsets(), device),
            weights=_static_tensor(weights, device) if weights is not None else None,
            stride=obj.stride(),
            # host metadata, fixed for the graph: readers then never compute it (a sync)
            length_per_key=list(obj.length_per_key()),
            offset_per_key=list(obj.offset_per_key()),
        )
    if isinstance(obj, dict):
        items = {k: _static(v, device, f"{path}[{k!r}]") for k, v in obj.items()}
        return items if type(obj) is dict else type(obj)(items)
    if isinstance(obj, (list, tuple)):
        items = [_static(v, device, f"{path}[{i}]") for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*items)
        return type(obj)(items)
    if _is_dataclass_instance(obj):
        return dataclasses.replace(
            obj, **{n: _static(getattr(obj, n), device, f"{path}.{n}") for n in _init_fields(obj)}
        )
    if isinstance(obj, _PLAIN):
        return obj
    raise BatchLayoutError(
        f"{path}: a {type(obj).__name__} cannot be held in static buffers (supported: tensors, "
        f"KeyedJaggedTensor, dict, list, tuple, dataclass, None / bool / int / float / str)"
    )


def _copy_tensor(static: torch.Tensor, new: Any, path: str) -> None:
    if not isinstance(new, torch.Tensor):
        raise BatchLayoutError(f"{path}: expected a tensor as in the captured batch, got {type(new).__name__}")
    if new.shape != static.shape:
        raise BatchLayoutError(
            f"{path}: shape {list(new.shape)} differs from the captured {list(static.shape)}; a captured "
            f"step replays fixed shapes (use one batch size, drop or pad the last batch, and a fixed "
            f"number of ids per feature: one-hot or padded)"
        )
    if new.dtype != static.dtype:
        raise BatchLayoutError(f"{path}: dtype {new.dtype} differs from the captured {static.dtype}")
    static.copy_(new.detach(), non_blocking=True)


def copy_into(static: Any, batch: Any, path: str = "batch") -> None:
    """Copy ``batch`` into the buffers of ``static`` (made by :func:`make_static`).

    Every tensor must have the captured shape and dtype, a KJT the captured keys,
    stride and ``length_per_key`` (ids per feature), and every plain value must be
    equal: the graph replays what was captured.

    Args:
        static: the static batch.
        batch: the new batch, same structure (any device).
        path: the name of the root in errors.

    Raises:
        BatchLayoutError: naming the first field that differs.

    Example::

        >>> static = make_static({"x": torch.zeros(2)}, "cpu")
        >>> copy_into(static, {"x": torch.ones(2)}); static["x"]
        tensor([1., 1.])
        >>> copy_into(static, {"x": torch.ones(3)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        comera_rec.training.cuda_graph.BatchLayoutError: batch['x']: shape [3] differs from the captured [2]; ...
    """
    if isinstance(static, torch.Tensor):
        _copy_tensor(static, batch, path)
        return
    kjt = _kjt_type()
    if kjt is not None and isinstance(static, kjt):
        if not isinstance(batch, kjt):
            raise BatchLayoutError(f"{path}: expected a KeyedJaggedTensor, got {type(batch).__name__}")
        if list(batch.keys()) != list(static.keys()):
            raise BatchLayoutError(f"{path}: keys {list(batch.keys())} differ from the captured {list(static.keys())}")
        if batch.variable_stride_per_key() or batch.stride() != static.stride():
            raise BatchLayoutError(
                f"{path}: stride (batch size) {batch.stride()} differs from the captured {static.stride()}"
            )
        lengths = list(batch.length_per_key())  # a sync only if the batch is on a GPU and lacks it
        if lengths != list(static.length_per_key()):
            raise BatchLayoutError(
                f"{path}: ids per feature (length_per_key) {lengths} differ from the captured "
                f"{list(static.length_per_key())}; a captured step needs a fixed number of ids per "
                f"feature (one-hot or padded)"
            )
        _copy_tensor(static.values(), batch.values(), f"{path}.values")
        _copy_tensor(static.lengths(), batch.lengths(), f"{path}.lengths")
        _copy_tensor(static.offsets(), batch.offsets(), f"{path}.offsets")
        weights = batch.weights_or_none()
        if (weights is None) != (static.weights_or_none() is None):
            raise BatchLayoutError(f"{path}.weights: present in one of the batch and the captured batch only")
        if weights is not None:
            _copy_tensor(static.weights(), weights, f"{path}.weights")
        return
    if isinstance(static, dict):
        if not isinstance(batch, dict) or list(batch.keys()) != list(static.keys()):
            got = list(batch.keys()) if isinstance(batch, dict) else type(batch).__name__
            raise BatchLayoutError(f"{path}: keys {got} differ from the captured {list(static.keys())}")
        for k, v in static.items():
            copy_into(v, batch[k], f"{path}[{k!r}]")
        return
    if isinstance(static, (list, tuple)):
        if type(batch) is not type(static) or len(batch) != len(static):
            raise BatchLayoutError(
                f"{path}: a {type(batch).__name__} of length {len(batch) if hasattr(batch, '__len__') else '?'} "
                f"differs from the captured {type(static).__name__} of length {len(static)}"
            )
        for i, (s, b) in enumerate(zip(static, batch)):
            copy_into(s, b, f"{path}[{i}]")
        return
    if _is_dataclass_instance(static):
        if type(batch) is not type(static):
            raise BatchLayoutError(
                f"{path}: a {type(batch).__name__} differs from the captured {type(static).__name__}"
            )
        for n in _init_fields(static):
            copy_into(getattr(static, n), getattr(batch, n), f"{path}.{n}")
        return
    if type(batch) is not type(static) or batch != static:
        raise BatchLayoutError(
            f"{path}: value {batch!r} differs from the captured {static!r} (plain values are "
            f"baked into the captured step)"
        )


def _detach_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return type(obj)((k, _detach_tree(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_detach_tree(v) for v in obj)
    return obj


@torch.no_grad()
def _copy_outputs(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_outputs(dst[k], src[k])
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            _copy_outputs(a, b)


# ---------------------------------------------------------------------------- capture backends


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


class _CudaCaptured:
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
        return _CudaCaptured(graph, outputs)


class _Recorded:
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
            self.outputs = _detach_tree(out)
        else:  # like a graph: the same output tensors, overwritten by every replay
            _copy_outputs(self.outputs, out)


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
        return _Recorded(self, fn, inputs)


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


# ---------------------------------------------------------------------------- the engine's step


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


def _takes_tensor_lr(optimizer: Any) -> bool:
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
            tensor_lr = _takes_tensor_lr(opt)
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


# ---------------------------------------------------------------------------- host-sync check

# operator -> why it cannot be captured
_SYNC_OPS = {
    "_local_scalar_dense": "reads a value on the host (.item(), bool(), int() or float() of a tensor)",
    "_unique": "torch.unique: output shape from the data",
    "_unique2": "torch.unique: output shape from the data",
    "unique_dim": "torch.unique: output shape from the data",
    "unique_consecutive": "torch.unique_consecutive: output shape from the data",
    "nonzero": "nonzero: output shape from the data",
    "masked_select": "masked_select: output shape from the data",
    "bincount": "bincount: output length from the largest value",
    "equal": "torch.equal returns a Python bool (a sync)",
    "is_nonzero": "a tensor's truth value read on the host",
    "lift_fresh": "a tensor made from Python data (torch.tensor): a host-to-device copy on a GPU",
    "lift_fresh_copy": "a tensor made from Python data (torch.tensor): a host-to-device copy on a GPU",
}


class _ForbidHostSyncs(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        why = _SYNC_OPS.get(name)
        if func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            # what repeat_interleave(x, repeats_tensor) decomposes to
            why = "repeat_interleave with tensor repeats and no output_size: output length from the data"
        if why is None and name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                why = "boolean-mask indexing: output shape from the data"
        if why is not None:
            raise HostSyncError(f"{func}: {why}; not capturable in a CUDA graph")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_syncs() -> Iterator[None]:
    """Raise :class:`HostSyncError` on operators that synchronise with the host or size
    their output from data, inside the block (forward and backward).

    A CPU-side check of what a CUDA graph capture would reject, by the dispatched ATen
    operators: ``.item()`` and truth values, ``unique``, ``nonzero``, ``bincount``,
    boolean-mask indexing, ``repeat_interleave`` without ``output_size``, tensors made
    from Python data. It cannot see host reads that dispatch no operator
    (``tolist()`` of a CPU tensor), device copies (everything is on the CPU here), or
    syncs inside a kernel's own implementation.

    Example::

        >>> with forbid_host_syncs():  # doctest: +ELLIPSIS
        ...     torch.ones(3).sum().item()
        Traceback (most recent call last):
        ...
        comera_rec.training.cuda_graph.HostSyncError: aten._local_scalar_dense.default: reads a value ...
    """
    with _ForbidHostSyncs():
        yield


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
    "copy_into",
    "forbid_host_syncs",
    "make_static",
]
