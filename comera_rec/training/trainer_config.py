"""The training loop's settings (:class:`TrainerConfig`) and what the engine needs from a
model kind (:class:`Task`, with :func:`task_hook` to look its hooks up); see
:mod:`comera_rec.training.engine`."""

from __future__ import annotations

from abc import ABCMeta
from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

import torch
from torch import nn

from comera_rec.training.metrics import BinaryMetrics


class TaskMetrics(Protocol):
    """What :meth:`Task.metrics` returns: validation metrics gathered over all processes."""

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one validation batch (the logits and labels :meth:`Task.step_loss` returned)."""
        ...

    def compute(self) -> dict[str, float]:
        """The metrics over every process (collective); must include ``"log_loss"``."""
        ...


REQUIRED_HOOKS: tuple[str, ...] = ("build_model", "wrap", "train_batches", "val_batches", "step_loss")
"""The hooks every task must define."""
OPTIONAL_HOOKS: tuple[str, ...] = (
    "check_batch",
    "optimizer_parameters",
    "extra_optimizers",
    "metrics",
    "checkpoint_config_keys",
    "train_position",
    "resume_train_position",
)
"""The hooks :class:`Task` gives a default to; the engine looks them up with :func:`task_hook`."""


class Task(metaclass=ABCMeta):
    """What the engine needs from a model kind (DLRM, transformer, a test toy).

    Subclass it and define the five required hooks; the optional ones have defaults that
    fit a binary click model trained by the engine's own optimiser alone. The engine
    also accepts objects that do not subclass :class:`Task` (it looks the optional hooks
    up with :func:`task_hook`), and ``isinstance(obj, Task)`` holds for any object with
    the required hooks, as when ``Task`` was a runtime-checkable ``Protocol``.

    Required hooks (the defaults here raise ``NotImplementedError``):

    * ``build_model(device) -> nn.Module``: the unwrapped model on ``device``, the same on
      every process; called once per ``fit()``, after seeding.
    * ``wrap(model) -> nn.Module``: the distributed wrapper (DDP, DMP) sharing ``model``'s
      parameters, or ``model`` itself; called after ``build_model``, again after every
      rank truncation, and after a resume's restore.
    * ``train_batches(epoch) -> Iterable``: this process's training batches of ``epoch``,
      the same sequence on every call (a resumed run skips the consumed ones); called at
      the start of each epoch (and once with epoch 0 for ``len()`` when the run is
      ``epochs`` long).
    * ``val_batches() -> Iterable``: this process's validation batches (from a private
      generator, not the global RNG); called at each validation.
    * ``step_loss(wrapped, batch) -> (loss, logits, labels)``: forward one batch: the mean
      loss to back-propagate and the logits and labels the metrics take; called every
      training step and on every validation batch (with ``wrapped`` in eval mode).

    Optional hooks (defaults below):

    * ``check_batch(batch)``: check a training batch on the host (raise on bad input);
      called by the graphed step before each batch goes into the captured step, where
      ``step_loss`` must not read the batch on the host (skip such checks when
      :func:`~comera_rec.training.cuda_graph.capturing`).
    * ``optimizer_parameters(wrapped)``: the parameters the engine's torch optimiser
      updates, or ``None`` for all of the model's; called when that optimiser is built.
    * ``extra_optimizers(wrapped) -> list``: further optimisers the engine steps, zeroes
      and checkpoints (e.g. TorchRec's fused one); called after every (re)wrap.
    * ``metrics(device) -> TaskMetrics``: fresh validation metrics; called at each validation.
    * ``checkpoint_config_keys() -> Sequence[str]``: run-config key prefixes a resume may
      not change; called when a checkpoint is restored.
    * ``train_position() -> dict | None`` and ``resume_train_position(epoch, positions) -> bool``:
      the data position as rows rather than a batch count, so a resume seeks instead of
      re-reading, and re-splits the rest of the epoch over another number of processes.

    Example::

        >>> class Clicks(Task):
        ...     def build_model(self, device):
        ...         return nn.Linear(4, 1).to(device)
        ...     def wrap(self, model):
        ...         return model
        ...     def train_batches(self, epoch):
        ...         gen = torch.Generator().manual_seed(epoch)
        ...         return [(torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen).float())]
        ...     def val_batches(self):
        ...         return self.train_batches(-1)
        ...     def step_loss(self, wrapped, batch):
        ...         logits = wrapped(batch[0]).squeeze(-1)
        ...         loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch[1])
        ...         return loss, logits, batch[1]
        >>> Clicks().checkpoint_config_keys()
        ()
        >>> Trainer(Clicks(), TrainerConfig(run_dir="runs/clicks", max_steps=10)).fit()  # doctest: +SKIP
    """

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        # keep the structural isinstance() of the former runtime-checkable Protocol
        if cls is Task:
            return all(callable(getattr(other, name, None)) for name in REQUIRED_HOOKS) or NotImplemented
        return NotImplemented

    # ------------------------------------------------------------------ required
    def build_model(self, device: torch.device) -> nn.Module:
        """Build the unwrapped model on ``device`` (called once, after seeding).

        Args:
            device: where the model's parameters go.
        """
        raise NotImplementedError(_missing(self, "build_model"))

    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap for distributed training (DDP, DMP) or return ``model`` itself.

        Args:
            model: the model :meth:`build_model` returned (after a truncation: cut).
        """
        raise NotImplementedError(_missing(self, "wrap"))

    def train_batches(self, epoch: int) -> Iterable[Any]:
        """This process's training batches of ``epoch``; the same sequence every call.

        Args:
            epoch: the 0-based epoch.
        """
        raise NotImplementedError(_missing(self, "train_batches"))

    def val_batches(self) -> Iterable[Any]:
        """This process's validation batches (use a private generator, not the global RNG)."""
        raise NotImplementedError(_missing(self, "val_batches"))

    def step_loss(self, wrapped: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward one batch: ``(mean loss, logits, labels)``.

        Args:
            wrapped: the model :meth:`wrap` returned.
            batch: one item of :meth:`train_batches` or :meth:`val_batches`.
        """
        raise NotImplementedError(_missing(self, "step_loss"))

    # ------------------------------------------------------------------ optional
    def check_batch(self, batch: Any) -> None:
        """Check a training batch on the host; raise on bad input. Nothing by default.

        The graphed step (``TrainerConfig.cuda_graphs``) calls it on every batch before
        copying it into the captured step's buffers: inside the capture ``step_loss`` runs
        once and is then replayed, so checks there would read only the first batch, and a
        host read would break the capture. A task whose ``step_loss`` validates its input
        skips that inside a capture and does the same checks here.

        Args:
            batch: one item of :meth:`train_batches`.
        """

    def optimizer_parameters(self, wrapped: nn.Module) -> Optional[Iterable[nn.Parameter]]:
        """The parameters the engine's torch optimiser updates.

        Args:
            wrapped: the model :meth:`wrap` returned.

        Returns:
            ``None`` (the default): every trainable parameter of the model; override to
            leave some out (e.g. tables an extra optimiser updates).
        """
        return None

    def extra_optimizers(self, wrapped: nn.Module) -> list[Any]:
        """Optimisers the engine steps, zeroes and checkpoints besides its torch one.

        Args:
            wrapped: the model :meth:`wrap` returned (asked again after every rewrap).

        Returns:
            Objects with ``step``, ``zero_grad``, ``state_dict``; none by default.
        """
        return []

    def metrics(self, device: torch.device) -> TaskMetrics:
        """Fresh validation metrics (one object per validation).

        Args:
            device: the training device (where the logits are).

        Returns:
            :class:`~comera_rec.training.metrics.BinaryMetrics` by default: AUC, accuracy
            and log loss.
        """
        return BinaryMetrics(device)

    def train_position(self) -> Optional[dict[str, Any]]:
        """Where this process's training data stands after the last batch it gave, as a
        plain dict of ints and lists (stored in checkpoints); asked at every checkpoint.

        Returns:
            ``None`` by default: the engine then records the batches consumed and, on
            resume, skips as many (re-reading them).
        """
        return None

    def resume_train_position(self, epoch: int, positions: Sequence[dict[str, Any]]) -> bool:
        """Make this process's next ``train_batches(epoch)`` start where the saved run left off.

        Args:
            epoch: the epoch the checkpoint was written in.
            positions: :meth:`train_position` of every process of the saved run, by rank
                (their number may differ from this run's: re-split what is left).

        Returns:
            True when the batches are positioned; ``False`` (the default): the engine skips
            the consumed batches instead.
        """
        return False

    def checkpoint_config_keys(self) -> Sequence[str]:
        """Run-config key prefixes (e.g. ``"model."``) a resumed run must share with its
        checkpoint; a difference under one of them is an ``IncompatibleCheckpointError``.

        Returns:
            ``()`` by default: config changes are only logged.
        """
        return ()


def _missing(task: object, name: str) -> str:
    return (
        f"{type(task).__name__} defines no {name}(); every task must define "
        f"{', '.join(REQUIRED_HOOKS)} (see comera_rec.training.trainer_config.Task)"
    )


_ABSENT = object()  # getattr's default: tells a missing hook from one set to None


def task_hook(task: object, name: str) -> Callable[..., Any]:
    """The hook ``name`` of ``task``: its own method, else :class:`Task`'s default bound to it.

    Lets the engine take task objects that do not subclass :class:`Task`.

    Args:
        task: any task object.
        name: a hook of :class:`Task` (see ``REQUIRED_HOOKS`` and ``OPTIONAL_HOOKS``).

    Raises:
        AttributeError: ``name`` is no hook of :class:`Task`.

    Example::

        >>> task_hook(object(), "extra_optimizers")(None)
        []
    """
    if name not in REQUIRED_HOOKS and name not in OPTIONAL_HOOKS:
        raise AttributeError(
            f"task_hook: {name!r} is no Task hook; hooks: {', '.join(REQUIRED_HOOKS + OPTIONAL_HOOKS)}"
        )
    own = getattr(task, name, _ABSENT)
    if own is not _ABSENT:
        return own
    # bound to the task, so a default may use the task's attributes like an inherited one
    return MethodType(getattr(Task, name), task)


AUTOCAST_DTYPES: dict[str, Optional[torch.dtype]] = {"none": None, "bfloat16": torch.bfloat16}
"""``TrainerConfig.autocast``'s values and the dtype each runs the forward in."""


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
    autocast: str = "none"
    """Mixed precision: "bfloat16" runs every forward (training and validation) under
    torch.autocast(device, torch.bfloat16) and the backward outside it; "none" trains in the
    parameters' dtype. Dense layers gain where the device has bfloat16 products (on a Zen 4
    CPU the dense demo trained 1.4-1.5x faster, dense TorchRec's Kaggle DLRM stepped 1.4-1.7x
    faster; performance.md). comera-rec's fused CPU kernels stay float32 under it
    (docs/tensor.md, "Mixed precision"), so a compressed model gains nothing on CPU: the
    compressed demo trained at 0.83-0.95x. Refused (a ValueError at the start of the run) on a
    CPU for which torch has no bfloat16 matrix kernels, such as an AVX2 x86 CPU: there every
    bfloat16 product runs in a reference loop, and the dense demo trained 21x slower on an
    AVX2 EPYC. Not with cuda_graphs."""
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
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(
                f"TrainerConfig.autocast (trainer.autocast) must be one of {', '.join(AUTOCAST_DTYPES)}, "
                f"got {self.autocast!r}"
            )
        if self.autocast != "none" and self.cuda_graphs:
            raise ValueError(
                "TrainerConfig: autocast with cuda_graphs has not been run on a GPU; "
                "set trainer.autocast=none or trainer.cuda_graphs=false"
            )
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"TrainerConfig.backend must be auto, gloo or nccl, got {self.backend!r}")
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            # Path("") is the working directory: the log, plots and checkpoints would land there
            raise ValueError(
                f"TrainerConfig.run_dir (trainer.run_dir) is empty ({self.run_dir!r}); it would write "
                f"the log and checkpoints into the working directory: give a folder, "
                f"e.g. trainer.run_dir=runs/my_run"
            )
