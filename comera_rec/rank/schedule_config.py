"""The rank schedule's settings (:class:`RankScheduleConfig`) and what its objective returns
(:class:`ObjectiveTerms`), both re-exported by :mod:`comera_rec.rank.schedule`: the mode,
the budget's window, floor and cut events, and the reference (threshold) schedule's loss
weights and stage switch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

MODES = ("budget", "threshold")
TARGET_TOLERANCE = 0.1  # budget mode: the size reached is within this fraction of the target
SWITCH_MODES = ("step", "plateau", "size_target")
SURROGATES = ("mean", "sum")


@dataclass
class RankScheduleConfig:
    """Settings of the rank-adaptive objective, the stage switch and truncation."""

    enabled: bool = True
    """Add the size terms at all; False trains on the task loss alone (dense baselines)."""
    mode: str = "budget"
    """"budget": reach the size target (target_size_bytes / target_size_ratio) on a planned
    path by cutting the slices of least loss cost per byte; "threshold": the reference
    schedule (gamma-weighted surrogate, cuts below threshold every truncate_every steps)."""
    prune_start: float = 0.05
    """budget: fraction of the run's steps after which cutting starts."""
    prune_end: float = 0.4
    """budget: fraction of the run's steps by which the target is reached; the rest of the
    run trains at the ranks found."""
    num_cuts: int = 20
    """budget: number of cut events, spread evenly over the window."""
    entry_exponent: float = 1.0
    """budget: slices are ranked by cost / entries ** entry_exponent (1: loss per byte)."""
    module_floor: float = 0.5
    """budget: no TT module is cut below this fraction of its share of the target (its
    starting size times target / starting size); 0: no floor, at most 1. 0.5 keeps the cost
    ranking from emptying a module whose slices look cheap early (docs/rank.md: +0.0013 AUC
    at 1/20 on the Kaggle shape, neutral on the demo); 0.9 cuts nearly in proportion
    (slightly better on the Kaggle shape at 1/4 and 1/10, worse on the demo at 1/20)."""
    module_floor_rule: str = "keep"
    """budget: "keep": no cut takes a module below its floor; "until": a module is cut only
    while it is above its floor, so it ends at most one slice under it (with module_floor=1
    every module ends near its proportional share however coarse its slices are)."""
    gamma: float = 0.01
    """Threshold mode: weight of the size surrogate S^ in the early stage (reference 0.01).
    Not used in budget mode."""
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
    target_size_ratio: float = 0.25
    """S0 as a fraction of S at the start of the run (budget) or at the switch (threshold;
    the reference run used 0.2); used when target_size_bytes is None."""
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
        for name in (
            "gamma",
            "beta",
            "threshold",
            "rho_loss",
            "rho_size",
            "w1",
            "w2",
            "plateau_min_delta",
            "entry_exponent",
            "module_floor",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ValueError(f"RankScheduleConfig.{name} must be a finite number >= 0, got {value!r}")
        for name in ("truncate_every", "switch_step", "plateau_patience"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"RankScheduleConfig.{name} must be an integer >= 0, got {value!r}")
        if self.mode not in MODES:
            raise ValueError(f"RankScheduleConfig.mode must be one of {MODES}, got {self.mode!r}")
        if not (0.0 <= self.prune_start < self.prune_end <= 1.0):
            raise ValueError(
                f"RankScheduleConfig: need 0 <= prune_start < prune_end <= 1, got prune_start="
                f"{self.prune_start!r}, prune_end={self.prune_end!r}"
            )
        if self.module_floor > 1.0:
            raise ValueError(
                f"RankScheduleConfig.module_floor must be at most 1 (the modules' floors would add up to "
                f"more than the target), got {self.module_floor!r}"
            )
        if self.module_floor_rule not in ("keep", "until"):
            raise ValueError(
                f"RankScheduleConfig.module_floor_rule must be 'keep' or 'until', got {self.module_floor_rule!r}"
            )
        if not isinstance(self.num_cuts, int) or self.num_cuts < 1:
            raise ValueError(f"RankScheduleConfig.num_cuts must be an integer >= 1, got {self.num_cuts!r}")
        if self.switch not in SWITCH_MODES:
            raise ValueError(f"RankScheduleConfig.switch must be one of {SWITCH_MODES}, got {self.switch!r}")
        if self.surrogate not in SURROGATES:
            raise ValueError(f"RankScheduleConfig.surrogate must be one of {SURROGATES}, got {self.surrogate!r}")
        if not 0.0 < self.target_size_ratio <= 1.0:
            raise ValueError(f"RankScheduleConfig.target_size_ratio must be in (0, 1], got {self.target_size_ratio!r}")
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
        stage: "early" or "late" (threshold mode); "early", "prune" or "finetune" (budget).
        choice: late stage only: "size" or "loss", the term descended this step.
    """

    loss: torch.Tensor
    task_loss: float
    surrogate: float
    size: int
    stage: str
    choice: Optional[str] = None
