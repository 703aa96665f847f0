"""The rank-adaptive objective and its two-stage schedule (method.md section 2).

Early stage (linear scalarisation)::

    L + gamma * S^ + beta * ||G||^2

Late stage (achievement scalarisation towards ``(L0, S0)``, sub-gradient form): each
step compare the normalised gaps ``w1 (L - L0) / L`` and ``w2 (S - S0) / S``; descend on
``w2 * S^`` when the size gap is the larger, on ``w1 * L`` otherwise, always plus
``rho_loss * L + rho_size * S^``.

``S`` is the method's size (core entries at the live ranks, summed over all TT modules),
``S^`` its differentiable surrogate: the L1 norm of the live rank-controller entries,
divided by their count (``surrogate="mean"``, the reference) or not (``"sum"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from comera_rec.rank.size import model_tt_size, size_element_bytes
from comera_rec.rank.truncation import TruncationResult, truncate_model
from comera_rec.tensor.train import tensor_train_modules

SWITCH_MODES = ("step", "plateau", "size_target")
SURROGATES = ("mean", "sum")


@dataclass
class RankScheduleConfig:
    """Settings of the rank-adaptive objective, the stage switch and truncation."""

    enabled: bool = True
    """Add the size terms at all; False trains on the task loss alone (dense baselines)."""
    gamma: float = 0.01
    """Weight of the size surrogate S^ in the early stage (reference 0.01)."""
    beta: float = 0.0
    """Weight of the squared L2 norm of the TT cores in the early stage (reference 0)."""
    threshold: float = 1e-2
    """tau: a controller entry with |D| below it is dead (reference 1e-2)."""
    truncate_every: int = 0
    """Cut dead ranks for real every this many optimiser steps; 0 never cuts."""
    surrogate: str = "mean"
    """S^ = L1 norm of the live controllers, "mean" (divided by their count, the reference) or "sum"."""
    late_stage: bool = False
    """Run the late stage (achievement scalarisation) after the switch."""
    switch: str = "step"
    """When the late stage starts: "step" (at switch_step), "plateau" (validation loss
    stops improving) or "size_target" (S in bytes falls to switch_size_bytes)."""
    switch_step: int = 0
    """Optimiser step at which switch="step" starts the late stage."""
    plateau_patience: int = 3
    """switch="plateau": evaluations without an improvement of at least plateau_min_delta."""
    plateau_min_delta: float = 1e-4
    """switch="plateau": smallest decrease of the validation loss that counts as progress."""
    switch_size_bytes: Optional[int] = None
    """switch="size_target": start the late stage once S (in bytes) is at most this."""
    target_size_bytes: Optional[int] = None
    """S0 in bytes; when None, S0 = target_size_ratio * S at the switch."""
    target_size_ratio: float = 0.2
    """S0 as a fraction of S at the switch (reference 0.2); used when target_size_bytes is None."""
    target_loss: float = 0.0
    """L0, the loss the late stage aims at."""
    rho_loss: float = 0.1
    """Late stage: weight of the always-present loss term (reference 0.1)."""
    rho_size: float = 0.01
    """Late stage: weight of the always-present size-surrogate term (reference 0.01)."""
    w1: float = 1.0
    """Late stage: weight of the loss gap and of the loss when it is descended."""
    w2: float = 1.0
    """Late stage: weight of the size gap and of S^ when it is descended."""

    def __post_init__(self) -> None:
        for name in ("gamma", "beta", "threshold", "rho_loss", "rho_size", "w1", "w2", "plateau_min_delta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ValueError(f"RankScheduleConfig.{name} must be a finite number >= 0, got {value!r}")
        for name in ("truncate_every", "switch_step", "plateau_patience"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"RankScheduleConfig.{name} must be an integer >= 0, got {value!r}")
        if self.switch not in SWITCH_MODES:
            raise ValueError(f"RankScheduleConfig.switch must be one of {SWITCH_MODES}, got {self.switch!r}")
        if self.surrogate not in SURROGATES:
            raise ValueError(f"RankScheduleConfig.surrogate must be one of {SURROGATES}, got {self.surrogate!r}")
        if not 0.0 < self.target_size_ratio <= 1.0:
            raise ValueError(
                f"RankScheduleConfig.target_size_ratio must be in (0, 1], got {self.target_size_ratio!r}"
            )
        if self.late_stage and self.switch == "size_target" and self.switch_size_bytes is None:
            raise ValueError('RankScheduleConfig: switch="size_target" needs switch_size_bytes')
        for name in ("switch_size_bytes", "target_size_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"RankScheduleConfig.{name} must be None or an integer >= 0, got {value!r}")


@dataclass
class ObjectiveTerms:
    """The loss to backpropagate and its parts (detached floats, for logging).

    Attributes:
        loss: the scalar to call ``backward()`` on.
        task_loss: L.
        surrogate: S^.
        size: S (core entries at the live ranks).
        stage: "early" or "late".
        choice: late stage only: "size" or "loss", the term descended this step.
    """

    loss: torch.Tensor
    task_loss: float
    surrogate: float
    size: int
    stage: str
    choice: Optional[str] = None


class RankSchedule:
    """The rank-adaptive objective, stage switch and truncation timing.

    The schedule's state (stage, switch step, S at the switch, plateau counters) is
    replicated: every input it reacts to (step, model, globally reduced losses) is the
    same on every process, so every process takes the same decisions.

    Args:
        config: the settings.

    Example::

        >>> schedule = RankSchedule(RankScheduleConfig(gamma=0.01, truncate_every=100))
        >>> terms = schedule.objective(model, task_loss, step)  # doctest: +SKIP
        >>> terms.loss.backward()  # doctest: +SKIP
        >>> if schedule.should_truncate(step + 1) and schedule.truncate(model):  # doctest: +SKIP
        ...     pass  # rebuild the DDP wrapper and the optimisers
    """

    def __init__(self, config: RankScheduleConfig) -> None:
        self.config = config
        self.stage = "early"
        self.switch_step: int = -1
        self.size_at_switch: int = 0
        self.best_val_loss: float = math.inf
        self.evals_without_improvement: int = 0
        self.last_choice: Optional[str] = None
        self.last_truncation: Optional[TruncationResult] = None
        self._element_bytes = 4

    # ------------------------------------------------------------------ size
    def size(self, model: nn.Module) -> int:
        """S over all TT modules at the configured threshold."""
        return model_tt_size(model, self.config.threshold)

    def size_bytes(self, model: nn.Module) -> int:
        """S in bytes."""
        return self.size(model) * size_element_bytes(model)

    def surrogate(self, model: nn.Module) -> torch.Tensor:
        """S^: L1 norm of the live controller entries (mean or sum, see the config)."""
        total: Optional[torch.Tensor] = None
        count = 0
        for _, m in tensor_train_modules(model):
            s, n = m.size_surrogate(self.config.threshold)
            total = s if total is None else total + s.to(total.device)
            count += n
        if total is None:
            return torch.zeros(())
        if self.config.surrogate == "mean":
            return total / max(1, count)
        return total

    def core_norm(self, model: nn.Module) -> torch.Tensor:
        """||G||^2: squared L2 norm of all TT cores."""
        total: Optional[torch.Tensor] = None
        for _, m in tensor_train_modules(model):
            for core in m.cores:
                sq = core.pow(2).sum()
                total = sq if total is None else total + sq.to(total.device)
        return torch.zeros(()) if total is None else total

    def target_size(self) -> float:
        """S0 in core entries (valid once the late stage has started)."""
        return float(self.size_at_switch) * self.config.target_size_ratio

    # ------------------------------------------------------------------ stages
    def _start_late(self, step: int, model: nn.Module) -> None:
        self.stage = "late"
        self.switch_step = step
        self.size_at_switch = self.size(model)

    def maybe_switch(self, step: int, model: nn.Module) -> bool:
        """Start the late stage if its step or size target is reached.

        Call once per step before :meth:`objective` (the plateau switch happens in
        :meth:`observe_validation`).

        Args:
            step: number of optimiser steps taken so far.
            model: the unwrapped model.

        Returns:
            True if the stage changed now.
        """
        c = self.config
        if not (c.enabled and c.late_stage) or self.stage == "late":
            return False
        if c.switch == "step" and step >= c.switch_step:
            self._start_late(step, model)
            return True
        if c.switch == "size_target" and c.switch_size_bytes is not None:
            if self.size_bytes(model) <= c.switch_size_bytes:
                self._start_late(step, model)
                return True
        return False

    def observe_validation(self, step: int, val_loss: float, model: nn.Module) -> bool:
        """Feed a (globally reduced) validation loss; switch on a plateau.

        Args:
            step: optimiser steps taken so far.
            val_loss: validation loss over all processes.
            model: the unwrapped model.

        Returns:
            True if the stage changed now.
        """
        c = self.config
        if val_loss < self.best_val_loss - c.plateau_min_delta:
            self.best_val_loss = float(val_loss)
            self.evals_without_improvement = 0
        else:
            self.evals_without_improvement += 1
        if not (c.enabled and c.late_stage) or self.stage == "late" or c.switch != "plateau":
            return False
        if self.evals_without_improvement >= c.plateau_patience:
            self._start_late(step, model)
            return True
        return False

    # ------------------------------------------------------------------ objective
    def objective(
        self,
        model: nn.Module,
        task_loss: torch.Tensor,
        step: int,
        global_task_loss: Optional[float] = None,
    ) -> ObjectiveTerms:
        """The loss to backpropagate at this step.

        Args:
            model: the unwrapped model holding the TT modules.
            task_loss: L on this process's batch (a scalar with a graph).
            step: optimiser steps taken so far (for the step switch).
            global_task_loss: L averaged over all processes; the late stage compares
                gaps with it so every process descends on the same term. When None and
                a process group is initialised, it is all-reduced here.

        Returns:
            :class:`ObjectiveTerms`.
        """
        c = self.config
        if not c.enabled:
            return ObjectiveTerms(task_loss, float(task_loss.detach()), 0.0, 0, self.stage)
        self._element_bytes = size_element_bytes(model)
        self.maybe_switch(step, model)
        s_hat = self.surrogate(model).to(task_loss.device)
        size = self.size(model)
        if self.stage == "early":
            loss = task_loss + c.gamma * s_hat
            if c.beta > 0:
                loss = loss + c.beta * self.core_norm(model).to(task_loss.device)
            self.last_choice = None
            return ObjectiveTerms(loss, float(task_loss.detach()), float(s_hat.detach()), size, "early")
        l_value = global_task_loss if global_task_loss is not None else _global_mean(task_loss)
        choice = self.late_choice(l_value, size)
        self.last_choice = choice
        main = c.w2 * s_hat if choice == "size" else c.w1 * task_loss
        loss = main + c.rho_loss * task_loss + c.rho_size * s_hat
        return ObjectiveTerms(loss, float(task_loss.detach()), float(s_hat.detach()), size, "late", choice)

    def late_choice(self, task_loss: float, size: float) -> str:
        """Which term the late stage descends: "size" if its normalised gap is larger.

        Args:
            task_loss: L (global).
            size: S in core entries.

        Example::

            >>> s = RankSchedule(RankScheduleConfig(target_loss=0.4)); s.size_at_switch = 1000
            >>> s.late_choice(0.5, 900)   # loss gap 0.2, size gap (900 - 200) / 900
            'size'
        """
        c = self.config
        s0 = self.target_size_elements()
        loss_gap = c.w1 * (task_loss - c.target_loss) / max(abs(task_loss), 1e-12)
        size_gap = c.w2 * (size - s0) / max(float(size), 1e-12)
        return "size" if size_gap > loss_gap else "loss"

    def target_size_elements(self) -> float:
        """S0 in core entries: the byte budget or the ratio of S at the switch."""
        if self.config.target_size_bytes is not None:
            return self.config.target_size_bytes / self._element_bytes
        return self.target_size()

    def __call__(self, model: nn.Module, task_loss: torch.Tensor, step: int) -> torch.Tensor:
        """Shorthand for ``objective(model, task_loss, step).loss``."""
        return self.objective(model, task_loss, step).loss

    # ------------------------------------------------------------------ truncation
    def should_truncate(self, step: int) -> bool:
        """True when ``step`` (optimiser steps taken) is a truncation step."""
        c = self.config
        return c.enabled and c.truncate_every > 0 and step > 0 and step % c.truncate_every == 0

    def truncate(self, model: nn.Module) -> bool:
        """Cut dead ranks of every TT module (``truncate_ranks(tau)``).

        The details (replaced parameters and kept indices, for moving optimiser state)
        are in :attr:`last_truncation`.

        Returns:
            True if shapes changed: rebuild the DDP wrapper and the optimisers.
        """
        self._element_bytes = size_element_bytes(model)
        self.last_truncation = truncate_model(model, self.config.threshold)
        return self.last_truncation.changed

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, object]:
        """Checkpointable state (ints, floats and strings only)."""
        return {
            "stage": self.stage,
            "switch_step": self.switch_step,
            "size_at_switch": self.size_at_switch,
            "best_val_loss": self.best_val_loss,
            "evals_without_improvement": self.evals_without_improvement,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        stage = state["stage"]
        if stage not in ("early", "late"):
            raise ValueError(f"RankSchedule.load_state_dict: bad stage {stage!r}")
        self.stage = str(stage)
        self.switch_step = int(state["switch_step"])  # type: ignore[arg-type]
        self.size_at_switch = int(state["size_at_switch"])  # type: ignore[arg-type]
        self.best_val_loss = float(state["best_val_loss"])  # type: ignore[arg-type]
        self.evals_without_improvement = int(state["evals_without_improvement"])  # type: ignore[arg-type]


def _global_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over all processes (the value itself without a process group)."""
    v = value.detach().float().reshape(1).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(v)
        v /= dist.get_world_size()
    return float(v)
