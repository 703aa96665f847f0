"""The training loop's settings (:class:`TrainerConfig`) and what the engine needs from a
model kind (:class:`Task`); see :mod:`comera_rec.training.engine`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, runtime_checkable

import torch
from torch import nn


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
