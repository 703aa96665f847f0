"""The training engine: one loop for every model kind, driven by a task object.

The engine owns the loop (forward, rank-adaptive objective, backward, optimiser steps),
rank truncation and the rebuild it forces, validation metrics over all processes,
checkpoints and resume, and the reports. It knows nothing of the model's kind: a *task*
supplies the model, the wrapper, the batches and the loss.

Task protocol (see :class:`Task`)::

    build_model(device) -> nn.Module            # the unwrapped model, same on every process
    wrap(model) -> nn.Module                    # DDP / DMP / identity; called again after truncation
    train_batches(epoch) -> Iterable            # this process's training batches of one epoch
    val_batches() -> Iterable                   # this process's validation batches
    step_loss(wrapped, batch) -> (loss, logits, labels)
    extra_optimizers(wrapped) -> list           # optional: e.g. TorchRec fused optimisers
    optimizer_parameters(wrapped) -> Iterable   # optional: what the torch optimiser updates
    checkpoint_config_keys() -> list[str]       # optional: config key prefixes a resume may not change

Batches must be deterministic given the epoch (so a resumed run can skip the consumed
ones) and the wrapper must share its parameters with the model ``build_model`` returned
(DDP does; so do DMP's replicated modules).

Example::

    >>> trainer = Trainer(task, TrainerConfig(run_dir="runs/x", max_steps=100),
    ...                   RankScheduleConfig(truncate_every=20), OptimConfig())  # doctest: +SKIP
    >>> summary = trainer.fit()  # doctest: +SKIP
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import random
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from comera_rec.config import to_dict
from comera_rec.rank.optim_state import retarget_optimizer
from comera_rec.rank.schedule import ObjectiveTerms, RankSchedule, RankScheduleConfig
from comera_rec.rank.size import (
    model_compression_ratio,
    model_live_ranks,
    model_num_bytes,
    model_ranks,
    model_tt_bytes,
    total_live_rank,
)
from comera_rec.rank.truncation import resize_to_state_dict
from comera_rec.tensor.embedding import set_static_shapes
from comera_rec.tensor.kernels import build_cpu_kernels
from comera_rec.tensor.train import tensor_train_modules
from comera_rec.training import faults
from comera_rec.training.async_save import PendingCheckpoint, Staging, save_checkpoint_async
from comera_rec.training.checkpoint import (
    SHARED_KEY,
    NonFiniteStateError,
    latest_checkpoint,
    load_checkpoint,
    restore_local,
    save_checkpoint,
)
from comera_rec.training.cuda_graph import CaptureBackend, CudaGraphCapture, StepGraphs, capturable_objective
from comera_rec.training.dcp_state import restore_shared, shared_model_shapes, shared_state
from comera_rec.training.dist import is_distributed, process_rank, restart_count, world_size
from comera_rec.training.metrics import BinaryMetrics
from comera_rec.training.optim import OptimConfig, build_optimizer, lr_factor, set_lr_factor
from comera_rec.training.report import JsonlLog, plot_run, read_jsonl, summary_table
from comera_rec.training.rundir import RunDir, open_run_dir
from comera_rec.training.stop import StopSignals, TrainingStopped, signal_name
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory

logger = logging.getLogger(__name__)

_NO_BATCH = object()  # what next() gives when this process's batches are exhausted


@runtime_checkable
class Task(Protocol):
    """What the engine needs from a model kind (DLRM, transformer, a test toy)."""

    def build_model(self, device: torch.device) -> nn.Module:
        """Build the unwrapped model on ``device`` (called once, after seeding)."""
        ...

    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap for distributed training (DDP, DMP) or return ``model`` itself."""
        ...

    def train_batches(self, epoch: int) -> Iterable[Any]:
        """This process's training batches of ``epoch``; the same sequence every call."""
        ...

    def val_batches(self) -> Iterable[Any]:
        """This process's validation batches (use a private generator, not the global RNG)."""
        ...

    def step_loss(self, wrapped: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward one batch: ``(mean loss, logits (B,), labels (B,))``."""
        ...


@dataclass
class TrainerConfig:
    """The training loop: length, intervals, run directory, device and resume."""

    run_dir: str = "runs/default"
    """Folder for the JSONL log, plots, summary and checkpoints/."""
    max_steps: int = 100
    """Optimiser steps (batches) to run; 0 runs `epochs` full passes instead."""
    epochs: int = 1
    """Passes over train_batches when max_steps is 0; with max_steps > 0 the data wraps into new epochs as needed."""
    log_every: int = 10
    """Write a train record (loss, throughput, ranks, size) every this many steps."""
    eval_every: int = 0
    """Validate every this many steps (0: only at the end)."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints to keep (0 keeps all)."""
    checkpoint_at_end: bool = True
    """Write a checkpoint after the last step."""
    async_checkpoint: bool = False
    """Write periodic checkpoints in a background thread (training waits only for a CPU copy
    of the state; comera_rec.training.async_save); the last one and a stop's are waited for."""
    seed: int = 0
    """Seed of torch, numpy and random (the same on every process, so models start equal)."""
    device: str = "auto"
    """"cpu", "cuda", "cuda:N" or "auto" (cuda:LOCAL_RANK when a GPU is present)."""
    backend: str = "auto"
    """Process group backend when launched with torchrun: "gloo", "nccl" or "auto"."""
    resume: bool = False
    """Continue from the newest complete checkpoint in run_dir/checkpoints; with none there,
    a FileNotFoundError naming the folder (a mistyped run_dir) unless resume_missing_ok.
    Workers restarted by torchrun (TORCHELASTIC_RESTART_COUNT > 0) always resume, and start
    afresh when no checkpoint has been written yet."""
    resume_missing_ok: bool = False
    """With resume: start afresh when run_dir holds no complete checkpoint instead of failing
    (for job scripts that always pass --resume)."""
    overwrite: bool = False
    """A fresh start (no resume) into a run_dir holding checkpoints fails (ExistingRunError);
    with overwrite the old run's files are moved into a new folder <run_dir>.old-<timestamp>
    next to it (nothing is deleted) and the run starts in the emptied run_dir."""
    skip_nonfinite: bool = True
    """Skip (and count) a batch whose loss or gradients are NaN / inf on any process instead of failing."""
    max_nonfinite: int = 100
    """Stop after more than this many skipped batches (the last good state is checkpointed first)."""
    check_grads: bool = True
    """Also check every gradient for NaN / inf before the optimiser step (one reduction per step)."""
    cuda_graphs: bool = False
    """Run each training step as captured CUDA graphs (forward + objective + backward, then clip +
    optimiser steps), re-captured after every truncation; TTM lookups switch to static shapes and
    input validation is off. CUDA only (a ValueError on CPU), one process, fixed batch shapes;
    the late rank stage runs eagerly. Never run on a GPU yet: see docs/gpu.md, "CUDA graphs"."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    plots: bool = True
    """Write PNG plots into run_dir at the end."""
    eval_max_batches: int = 0
    """Validate on at most this many batches per process (0: all)."""
    keep_freed_memory: bool = True
    """On CPU, let glibc malloc reuse freed activation buffers instead of returning them to the
    kernel (see comera_rec.utils.host). Process-wide. A compressed model alone in its process
    otherwise page-faults ~3,500 times per Kaggle DLRM step and trains 10-25% slower
    (performance.md); peak RSS is unchanged."""
    freeze_gc: bool = True
    """Once the model, optimisers and data are set up, move every object then alive out of
    the cycle collector's walks (``gc.freeze``; comera_rec.utils.host): with TorchRec
    imported that is ~350k objects each full collection would otherwise traverse."""

    def __post_init__(self) -> None:
        for name in (
            "max_steps",
            "epochs",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
            "max_nonfinite",
            "eval_max_batches",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainerConfig.{name} must be an integer >= 0, got {value!r}")
        if self.max_steps == 0 and self.epochs == 0:
            raise ValueError("TrainerConfig: max_steps and epochs are both 0; nothing to train")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"TrainerConfig.backend must be auto, gloo or nccl, got {self.backend!r}")
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            # Path("") is the working directory: the log, plots and checkpoints would land there
            raise ValueError(
                f"TrainerConfig.run_dir (trainer.run_dir) is empty ({self.run_dir!r}); it would write "
                f"the log and checkpoints into the working directory: give a folder, "
                f"e.g. trainer.run_dir=runs/my_run"
            )


class IncompatibleCheckpointError(ValueError):
    """A checkpoint was written by a run whose model does not fit this one."""


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for k, v in config.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: config}


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def config_differences(saved: Any, current: Any, ignore: tuple[str, ...] = ("trainer.",)) -> list[str]:
    """``key (checkpoint X, now Y)`` for every config key whose value differs.

    Args:
        saved: the config dict stored in a checkpoint's meta.json.
        current: this run's config dict.
        ignore: key prefixes that may change between a run and its resumption.
    """
    a, b = _flatten(saved or {}), _flatten(current or {})
    keys = sorted(set(a) | set(b))
    return [
        f"{k} (checkpoint {_short(a.get(k, '<absent>'))}, now {_short(b.get(k, '<absent>'))})"
        for k in keys
        if not k.startswith(ignore) and a.get(k, "<absent>") != b.get(k, "<absent>")
    ]


def _rank_dims(model: nn.Module) -> dict[str, set[int]]:
    """State-dict key of every TT core / controller -> its dims that are TT ranks."""
    out: dict[str, set[int]] = {}
    for name, module in tensor_train_modules(model):
        prefix = f"{name}." if name else ""
        batch_dims = module.controllers[0].dim() - 1 if len(module.controllers) else 0
        for k, core in enumerate(module.cores):
            out[f"{prefix}cores.{k}"] = {batch_dims, core.dim() - 1}
        for k, ctrl in enumerate(module.controllers):
            out[f"{prefix}controllers.{k}"] = {ctrl.dim() - 1}
    return out


def state_dict_mismatches(model: nn.Module, saved: dict[str, Any]) -> list[str]:
    """How ``saved`` fails to fit ``model``: missing / unexpected keys and shape mismatches.

    TT cores and controllers may differ in their rank dimensions (a checkpoint taken
    after truncation); every other dimension must match.
    """
    current = model.state_dict()
    rank_dims = _rank_dims(model)
    problems: list[str] = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"missing from the checkpoint: {missing[:10]}" + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        problems.append(f"not in the model: {unexpected[:10]}" + (" ..." if len(unexpected) > 10 else ""))
    for key, tensor in current.items():
        if key not in saved or not hasattr(tensor, "shape") or not hasattr(saved[key], "shape"):
            continue
        a, b = tuple(saved[key].shape), tuple(tensor.shape)
        if a == b:
            continue
        dims = rank_dims.get(key)
        if dims is not None and len(a) == len(b) and all(x == y for i, (x, y) in enumerate(zip(a, b)) if i not in dims):
            continue
        problems.append(f"{key}: shape {list(a)} in the checkpoint, {list(b)} in the model")
    return problems


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA allocations on a GPU, else peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _rng_state(device: torch.device) -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py_state[0], torch.tensor(py_state[1], dtype=torch.int64), py_state[2]],
        "numpy": [
            np_state[0],
            torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(int(x) for x in py[1].tolist()), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], npst[1].numpy().astype(np.uint32), npst[2], npst[3], npst[4]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Trainer:
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

    # ------------------------------------------------------------------ setup
    def _init_distributed(self) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            backend = self.config.backend
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            restarts = restart_count()
            if restarts > 0 and "MASTER_ADDR" in os.environ:
                # torchrun keeps one store across restarts; keys left by the killed attempt
                # (peer addresses) would make the new group connect to dead processes
                rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
                agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    world,
                    is_master=not agent_store and rank == 0,
                )
                dist.init_process_group(
                    backend,
                    store=dist.PrefixStore(f"comera_rec/attempt_{restarts}", store),
                    rank=rank,
                    world_size=world,
                )
            else:
                dist.init_process_group(backend)
            self._owns_group = True

    def _device(self) -> torch.device:
        name = self.config.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"trainer.device={self.config.device!r} asks for a GPU, but CUDA is not available "
                f"here (no GPU, no driver, or a CPU-only torch build); set trainer.device=cpu, "
                f"or auto to use a GPU only where there is one"
            )
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"trainer.device={self.config.device!r}, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s): cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def _check_writable(self) -> None:
        """Fail before training when the run's folders cannot be written: ``run_dir`` (rank 0
        writes the log, plots and summary there) and, with checkpoints on
        (``checkpoint_at_end`` or ``checkpoint_every``), its ``checkpoints/`` folder, which
        every process writes its rank file into. Both are created when missing.

        Raises:
            OSError: naming trainer.run_dir, the folder and the reason (a file in the way,
                no permission, a read-only file system).
        """
        cfg = self.config
        folders = [self.run_dir] if process_rank() == 0 else []
        if cfg.checkpoint_at_end or cfg.checkpoint_every:
            folders.append(self.run_dir / "checkpoints")
        for folder in folders:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=f".write-test-rank{process_rank()}-", dir=folder)
                os.close(fd)
                os.unlink(probe)
            except OSError as e:
                what = (
                    "checkpoints are on (trainer.checkpoint_at_end / checkpoint_every), and "
                    if folder != self.run_dir
                    else ""
                )
                raise OSError(
                    e.errno,
                    f"trainer.run_dir={cfg.run_dir!r}: {what}cannot write into {folder} "
                    f"({e.strerror or e}); choose a writable trainer.run_dir",
                ) from e

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

    @property
    def optimizers(self) -> list[Any]:
        return ([self.optimizer] if self.optimizer is not None else []) + list(self.extra)

    def _build_optimizers(self, truncation: Any = None) -> None:
        if self.optimizer is None:
            include = None
            if hasattr(self.task, "optimizer_parameters"):
                include = list(self.task.optimizer_parameters(self.wrapped))
            self.optimizer = build_optimizer(self.model, self.optim_config, include, self._capturable)
        elif truncation is not None:
            # the path RankAdapter users take: the same optimiser, pointed at the cut
            # parameters with its state sliced (comera_rec/rank/optim_state.py)
            retarget_optimizer(self.optimizers, truncation)
        self.extra = list(self.task.extra_optimizers(self.wrapped)) if hasattr(self.task, "extra_optimizers") else []

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

    # ------------------------------------------------------------------ CUDA graphs
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
        """Captured part 2: the clip of ``_clip_and_schedule`` and the optimiser steps (the
        rates are set on the host before, see ``StepGraphs``)."""
        oc = self.optim_config
        if getattr(oc, "clip_grad_norm", 0) > 0:
            grads = [p for p in self.model.parameters() if p.grad is not None]
            if grads:
                torch.nn.utils.clip_grad_norm_(grads, oc.clip_grad_norm)
        for opt in self.optimizers:
            opt.step()

    # ------------------------------------------------------------------ data
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

    def _batches(self) -> Iterator[Any]:
        """Training batches from the saved position on, wrapping into new epochs."""
        while True:
            if self.config.max_steps == 0 and self.epoch >= self.config.epochs:
                return
            it = iter(self.task.train_batches(self.epoch))
            if self.batch_in_epoch:
                it = itertools.islice(it, self.batch_in_epoch, None)
            empty = True
            for batch in it:
                empty = False
                yield batch
            if empty and self.batch_in_epoch == 0:
                raise RuntimeError(f"task.train_batches({self.epoch}) yielded no batches")
            self.epoch += 1
            self.batch_in_epoch = 0

    # ------------------------------------------------------------------ checkpoint
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
            },
            "rng": _rng_state(self.device),
        }

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
        fixed = tuple(self.task.checkpoint_config_keys()) if hasattr(self.task, "checkpoint_config_keys") else ()
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
            saved = int(meta.get("world_size", 1))
            if saved != world_size() and process_rank() == 0:
                logger.warning(
                    "resuming %s, written by %d process(es), with %d: the model and optimiser state are "
                    "resharded; the data position is kept per process (batch %d of each process's part), "
                    "so the batches differ from an uninterrupted run",
                    path,
                    saved,
                    world_size(),
                    int(state["trainer"]["batch_in_epoch"]),
                )
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

    # ------------------------------------------------------------------ metrics
    def _size_record(self) -> dict[str, Any]:
        tau = self.schedule.config.threshold
        return {
            "live_rank": total_live_rank(self.model, tau),
            "tt_bytes": model_tt_bytes(self.model, tau),  # what a rank target counts
            "model_bytes": model_num_bytes(self.model, tau),  # every parameter
            "compression": model_compression_ratio(self.model, tau),
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation metrics over all processes (collective): the task's own
        ``metrics(device)`` when it has one, else AUC, accuracy and log loss."""
        metrics = self.task.metrics(self.device) if hasattr(self.task, "metrics") else BinaryMetrics(self.device)
        self.wrapped.eval()
        try:
            batches = self.task.val_batches()
            if self.config.eval_max_batches:
                batches = itertools.islice(batches, self.config.eval_max_batches)
            for batch in batches:
                _, logits, labels = self.task.step_loss(self.wrapped, batch)
                metrics.update(logits, labels)
            result = metrics.compute()
        finally:
            self.wrapped.train()
        self.last_eval = result
        self.schedule.observe_validation(self.step, result["log_loss"], self.model)
        return result

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

    def _clip_and_schedule(self, total_steps: Optional[int]) -> None:
        """Clip the gradient norm (gradients are already all-reduced, so every process
        clips alike) and set this step's learning rates (warm-up / decay)."""
        oc = self.optim_config
        if oc.clip_grad_norm > 0:
            grads = [p for p in self.model.parameters() if p.grad is not None]
            if grads:
                torch.nn.utils.clip_grad_norm_(grads, oc.clip_grad_norm)
        if oc.warmup_steps or oc.decay != "none":
            set_lr_factor(self.optimizers, lr_factor(oc, self.step, total_steps))

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
        import json

        from tqdm import tqdm

        cfg = self.config
        self._init_distributed()
        self.device = self._device()
        if cfg.cuda_graphs:
            self._check_cuda_graphs()
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
            _set_rng_state(self._rng_to_restore, self.device)
        total = cfg.max_steps if cfg.max_steps > 0 else None
        self.schedule.set_total_steps(total if total is not None else self._epoch_steps())
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
            graphed = self._graphs is not None and self._graphs_usable()
            if graphed:  # replays (after warm-up) forward, objective and backward
                loss, labels, objective, surrogate = self._graphs.forward_backward(batch)
            else:
                loss, _, labels = self.task.step_loss(self.wrapped, batch)
            global_loss, finite = self._reduce_loss(loss)
            self.batch_in_epoch += 1
            if not finite:
                self._skip_nonfinite("loss")
                bar.update(1)
                continue
            if graphed:  # size S is not read by the loop: not computed (a host sync per module)
                terms = ObjectiveTerms(objective, float(loss), float(surrogate), 0, self.schedule.stage)
            else:
                terms = self.schedule.objective(self.model, loss, self.step, global_task_loss=global_loss)
                terms.loss.backward()
            if cfg.check_grads and not self._grads_finite():
                self._skip_nonfinite("gradients")
                bar.update(1)
                continue
            self.schedule.observe_gradients(self.model)  # slice costs for the budget's cuts
            if graphed:  # the rates on the host, then the captured clip and optimiser steps
                oc = self.optim_config
                if oc.warmup_steps or oc.decay != "none":
                    set_lr_factor(self.optimizers, lr_factor(oc, self.step, total))
                self._graphs.update(self.optimizers)
            else:
                self._clip_and_schedule(total)
                for opt in self.optimizers:
                    opt.step()
            self._zero_grad()
            self.step += 1
            faults.maybe_kill(faults.KILL_AT_STEP, self.step, rank, self.run_dir)
            n = int(labels.shape[0]) * world_size()
            self.samples += n
            self.losses.append(global_loss)
            truncated = False
            if self.schedule.should_truncate(self.step) and self.schedule.truncate(self.model, self.step):
                self._rebuild_after_truncation()
                self.truncations += 1
                truncated = True
            window_time += time.perf_counter() - t0
            window_loss += global_loss
            window_steps += 1
            window_samples += n
            bar.update(1)
            if truncated and log is not None:
                tr = self.schedule.last_truncation
                log.write(
                    {
                        "kind": "truncate",
                        "step": self.step,
                        "ranks_before": tr.ranks_before,
                        "ranks_after": tr.ranks_after,
                        "cuts": len(self.schedule.last_cuts),
                        "tt_bytes": model_tt_bytes(self.model, self.schedule.config.threshold),
                    }
                )
            if cfg.log_every and self.step % cfg.log_every == 0:
                tput = window_samples / max(window_time, 1e-9)
                throughputs.append(tput)
                record = {
                    "kind": "train",
                    "step": self.step,
                    "loss": window_loss / window_steps,
                    "objective": float(terms.loss.detach()),
                    "surrogate": terms.surrogate,
                    "stage": terms.stage,
                    "choice": terms.choice,
                    "samples_per_s": tput,
                    "peak_mem_mb": peak_memory_mb(self.device),
                    "nonfinite": self.nonfinite,
                    **self._size_record(),
                }
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
        if not (cfg.eval_every and self.step % cfg.eval_every == 0 and self.last_eval):
            result = self.evaluate()
            if log is not None:
                log.write({"kind": "eval", "step": self.step, **result, "stage": self.schedule.stage})
        if cfg.checkpoint_at_end and not (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
            self.save()
        self.wait_for_checkpoint()  # the run ends with its last checkpoint complete
        size = self._size_record()
        summary: dict[str, Any] = {
            "steps": self.step,
            "samples": self.samples,
            "world_size": world_size(),
            "final_train_loss": self.losses[-1] if self.losses else float("nan"),
            # every validation metric the task reports (auc / accuracy / log_loss for DLRM)
            **{f"val_{k}": v for k, v in self.last_eval.items() if k != "count"},
            "samples_per_s": float(np.mean(throughputs)) if throughputs else float("nan"),
            "peak_mem_mb": peak_memory_mb(self.device),
            "live_rank": size["live_rank"],
            "tt_bytes": size["tt_bytes"],
            "model_bytes": size["model_bytes"],
            **({"target_bytes": self.schedule.target_bytes()} if self.schedule.target_bytes() is not None else {}),
            "compression": size["compression"],
            "truncations": self.truncations,
            "nonfinite_skipped": self.nonfinite,
            "stage": self.schedule.stage,
            "wall_s": time.perf_counter() - wall0,
        }
        if rank == 0:
            table = summary_table(summary)
            print(table, flush=True)
            (self.run_dir / "summary.txt").write_text(table + "\n")
            (self.run_dir / "summary.json").write_text(
                json.dumps(
                    {**summary, "live_ranks": model_live_ranks(self.model, self.schedule.config.threshold)},
                    indent=1,
                    default=str,
                )
            )
            if log is not None:
                log.write({"kind": "summary", **summary})
            if cfg.plots:
                plot_run(read_jsonl(self.run_dir / "log.jsonl"), self.run_dir)
        return summary

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
