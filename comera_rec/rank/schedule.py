"""The rank-adaptive objective and its schedule (method.md section 2).

Two modes. ``mode="budget"`` (the default) asks for a size, not a ``gamma``: the live size
follows a plan from the starting size down to the target ``S0`` (``target_size_bytes`` or
``target_size_ratio`` of the starting size) between ``prune_start`` and ``prune_end`` (as
fractions of the run's steps), cutting at each event the rank slices whose loss cost per
byte is least (:mod:`comera_rec.rank.budget`); after ``prune_end`` the model trains on at
the ranks found. Its stages are "early" (before the window), "prune" and "finetune".

``mode="threshold"`` is the reference schedule, kept for comparison (docs/rank.md):

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
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from comera_rec.rank.budget import (
    SliceImportance,
    apply_cuts,
    cut_plan_steps,
    planned_size,
)
from comera_rec.rank.schedule_config import (  # noqa: F401  (re-exported: the config's public home was here)
    MODES,
    SURROGATES,
    SWITCH_MODES,
    TARGET_TOLERANCE,
    ObjectiveTerms,
    RankScheduleConfig,
)
from comera_rec.rank.size import model_tt_size, size_element_bytes
from comera_rec.rank.truncation import TruncationResult, truncate_model
from comera_rec.tensor.train import tensor_train_modules


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
        # budget mode
        self.total_steps: Optional[int] = None
        self.size_at_start: int = 0
        self.module_sizes_at_start: dict[str, int] = {}
        self.importance = SliceImportance(config.threshold)
        self.last_cuts: list = []

    # ------------------------------------------------------------------ budget plan
    @property
    def budget(self) -> bool:
        """Whether the schedule steers to a size target (``mode="budget"``) and is on."""
        return self.config.enabled and self.config.mode == "budget"

    def set_total_steps(self, total_steps: Optional[int]) -> None:
        """Tell the budget schedule how long the run is (the Trainer does, from its config).

        Args:
            total_steps: optimiser steps of the whole run; None when unknown (the budget
                schedule then never cuts).
        """
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
            raise ValueError(f"RankSchedule.set_total_steps: expected a positive integer, got {total_steps!r}")
        self.total_steps = total_steps

    def window(self) -> tuple[int, int]:
        """Budget mode: the (first, last) step of the cutting window.

        Raises:
            ValueError: the run's length is unknown (see :meth:`set_total_steps`).
        """
        if self.total_steps is None:
            raise ValueError(
                "RankSchedule(mode='budget') needs the run's length to plan its cuts: call "
                "set_total_steps() (the Trainer does, from trainer.max_steps)"
            )
        c = self.config
        start = int(round(c.prune_start * self.total_steps))
        end = max(start + 1, int(round(c.prune_end * self.total_steps)))
        return start, end

    def cut_steps(self) -> list[int]:
        """Budget mode: the steps at which slices are cut (empty when the length is unknown)."""
        if not self.budget or self.total_steps is None:
            return []
        start, end = self.window()
        return cut_plan_steps(start, end, self.config.num_cuts)

    def budget_stage(self, step: int) -> str:
        """Budget mode: "early" before the window, "prune" inside, "finetune" after."""
        if self.total_steps is None:
            return "early"
        start, end = self.window()
        return "early" if step < start else ("prune" if step < end else "finetune")

    def _note_start(self, model: nn.Module) -> None:
        if self.size_at_start == 0:
            self.size_at_start = self.size(model)
            self._element_bytes = size_element_bytes(model)
            self.module_sizes_at_start = {
                name: int(m.tt_size(self.config.threshold)) for name, m in tensor_train_modules(model)
            }

    def module_floors(self) -> dict[str, float]:
        """Budget mode: the size (entries) below which no cut takes each module."""
        if self.config.module_floor <= 0 or self.size_at_start == 0:
            return {}
        ratio = self.target_size_elements() / self.size_at_start
        return {name: self.config.module_floor * ratio * size for name, size in self.module_sizes_at_start.items()}

    def planned_size(self, step: int) -> float:
        """Budget mode: the size (core entries) the plan asks for after ``step`` steps."""
        start, end = self.window()
        return planned_size(step, start, end, self.size_at_start, self.target_size_elements())

    def observe_gradients(self, model: nn.Module) -> None:
        """Budget mode: after each backward (gradients all-reduced), add this step's slice
        costs; a no-op otherwise and after the window."""
        if not self.budget or self.total_steps is None or self.stage == "finetune":
            return
        self.importance.observe(model)

    def capturable(self, step: int, model: nn.Module) -> bool:
        """Whether this step's objective can be captured in a CUDA graph: always in budget
        mode (the objective is the task loss), the early stage in threshold mode."""
        c = self.config
        if not c.enabled:
            return True
        self.maybe_switch(step, model)
        return c.mode == "budget" or self.stage == "early"

    # ------------------------------------------------------------------ size
    def size(self, model: nn.Module) -> int:
        """S over all TT modules at the configured threshold."""
        return model_tt_size(model, self.config.threshold)

    def size_bytes(self, model: nn.Module) -> int:
        """S in bytes."""
        return self.size(model) * size_element_bytes(model)

    def surrogate(self, model: nn.Module, on_device: bool = False) -> torch.Tensor:
        """S^: L1 norm of the live controller entries (mean or sum, see the config).

        Args:
            model: the unwrapped model.
            on_device: keep the live-entry count a device tensor (no host synchronisation,
                capturable in a CUDA graph); the value is the same.
        """
        total: Optional[torch.Tensor] = None
        count: Any = None
        for _, m in tensor_train_modules(model):
            s, n = m.size_surrogate(self.config.threshold, count_as_tensor=on_device)
            total = s if total is None else total + s.to(total.device)
            count = n if count is None else count + (n.to(count.device) if on_device else n)
        if total is None:
            return torch.zeros(())
        if self.config.surrogate == "mean":
            return total / (count.clamp_min(1) if on_device else max(1, count))
        return total

    def early_objective(
        self, model: nn.Module, task_loss: torch.Tensor, on_device: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The early stage's loss ``L + gamma * S^ (+ beta * ||G||^2)`` and ``S^``.

        ``on_device`` computes it without host synchronisation (the CUDA-graph step,
        ``comera_rec.training.cuda_graph.capturable_objective``); the values are the same.
        """
        c = self.config
        s_hat = self.surrogate(model, on_device).to(task_loss.device)
        loss = task_loss + c.gamma * s_hat
        if c.beta > 0:
            loss = loss + c.beta * self.core_norm(model).to(task_loss.device)
        return loss, s_hat

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
        if self.budget:
            self._note_start(model)
            stage, self.stage = self.stage, self.budget_stage(step)
            return stage != self.stage
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
        if not (c.enabled and c.late_stage) or self.stage == "late" or c.switch != "plateau" or self.budget:
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
        if self.budget:  # the size is steered by cuts, not by a term of the loss
            return ObjectiveTerms(task_loss, float(task_loss.detach()), 0.0, self.size(model), self.stage)
        size = self.size(model)
        if self.stage == "early":
            loss, s_hat = self.early_objective(model, task_loss)
            self.last_choice = None
            return ObjectiveTerms(loss, float(task_loss.detach()), float(s_hat.detach()), size, "early")
        s_hat = self.surrogate(model).to(task_loss.device)
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
        """S0 in core entries: the byte budget, or the ratio of S at the start (budget mode)
        or at the switch (threshold mode)."""
        if self.config.target_size_bytes is not None:
            return self.config.target_size_bytes / self._element_bytes
        if self.config.mode == "budget":
            return float(self.size_at_start) * self.config.target_size_ratio
        return self.target_size()

    def target_bytes(self) -> Optional[int]:
        """Budget mode: S0 in bytes (None in threshold mode or before the start is known)."""
        if not self.budget or (self.size_at_start == 0 and self.config.target_size_bytes is None):
            return None
        return int(round(self.target_size_elements() * self._element_bytes))

    def __call__(self, model: nn.Module, task_loss: torch.Tensor, step: int) -> torch.Tensor:
        """Shorthand for ``objective(model, task_loss, step).loss``."""
        return self.objective(model, task_loss, step).loss

    # ------------------------------------------------------------------ truncation
    def should_truncate(self, step: int) -> bool:
        """True when ``step`` (optimiser steps taken) is a truncation step."""
        c = self.config
        if self.budget:
            return step in self.cut_steps()
        return c.enabled and c.truncate_every > 0 and step > 0 and step % c.truncate_every == 0

    def truncate(self, model: nn.Module, step: Optional[int] = None) -> bool:
        """Cut ranks of every TT module.

        Threshold mode: the dead slices (``truncate_ranks(tau)``). Budget mode: also the
        slices of least loss cost per byte until the live size is at most the plan's size
        at ``step`` (the target at the end of the window; see :mod:`comera_rec.rank.budget`),
        listed in :attr:`last_cuts`. The details (replaced parameters and kept indices, for
        moving optimiser state) are in :attr:`last_truncation`.

        Args:
            model: the unwrapped model.
            step: optimiser steps taken (budget mode; None: the end of the window).

        Returns:
            True if shapes changed: rebuild the DDP wrapper and the optimisers.
        """
        self._element_bytes = size_element_bytes(model)
        self.last_cuts = []
        if self.budget and self.total_steps is not None:
            self._note_start(model)
            target = self.planned_size(self.window()[1] if step is None else step)
            floor = (1.0 - TARGET_TOLERANCE / 2) * self.target_size_elements()
            self.last_cuts = self.importance.select(
                model, target, floor, self.config.entry_exponent, self.module_floors(), self.config.module_floor_rule
            )
            apply_cuts(model, self.last_cuts)
            self.importance.reset()
        self.last_truncation = truncate_model(model, self.config.threshold)
        return self.last_truncation.changed

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, object]:
        """Checkpointable state (ints, floats, strings and lists / dicts of them)."""
        return {
            "stage": self.stage,
            "switch_step": self.switch_step,
            "size_at_switch": self.size_at_switch,
            "best_val_loss": self.best_val_loss,
            "evals_without_improvement": self.evals_without_improvement,
            "size_at_start": self.size_at_start,
            "module_sizes_at_start": dict(self.module_sizes_at_start),
            # budget: the slice costs gathered since the last cut, so a resumed run cuts as an
            # uninterrupted one would ("module|bond" -> floats)
            "slice_costs": {
                f"{name}|{k}": [float(v) for v in cost.tolist()] for (name, k), cost in self.importance.costs.items()
            },
            "slice_cost_steps": self.importance.steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""
        stage = state["stage"]
        if stage not in ("early", "late", "prune", "finetune"):
            raise ValueError(f"RankSchedule.load_state_dict: bad stage {stage!r}")
        self.stage = str(stage)
        self.switch_step = int(state["switch_step"])  # type: ignore[arg-type]
        self.size_at_switch = int(state["size_at_switch"])  # type: ignore[arg-type]
        self.best_val_loss = float(state["best_val_loss"])  # type: ignore[arg-type]
        self.evals_without_improvement = int(state["evals_without_improvement"])  # type: ignore[arg-type]
        self.size_at_start = int(state.get("size_at_start", 0))  # type: ignore[arg-type]
        self.module_sizes_at_start = {str(k): int(v) for k, v in dict(state.get("module_sizes_at_start", {})).items()}  # type: ignore[arg-type]
        self.importance.reset()
        for key, values in dict(state.get("slice_costs", {})).items():  # type: ignore[arg-type]
            name, _, bond = str(key).rpartition("|")
            self.importance.costs[(name, int(bond))] = torch.tensor(values, dtype=torch.float32)
        self.importance.steps = int(state.get("slice_cost_steps", 0))  # type: ignore[arg-type]


def _global_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over all processes (the value itself without a process group)."""
    v = value.detach().float().reshape(1).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(v)
        v /= dist.get_world_size()
    return float(v)
