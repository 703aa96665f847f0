"""Optimisers with separate learning rates for TT cores, rank controllers and the rest,
and their rebuild after a rank truncation.

After truncation the cut cores and controllers are new ``nn.Parameter`` objects. The
rebuilt optimiser keeps the state of every parameter that did not change as it is, and
slices the state of each cut parameter (``exp_avg``, ``exp_avg_sq``, Adagrad's ``sum``,
SGD's ``momentum_buffer``: every state tensor shaped like the parameter) along the kept
rank indices; scalar state (``step``) is copied. When the kept indices are unknown the
cut parameter's state is dropped (the optimiser starts it afresh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from comera_rec.rank.optim_state import sliced_state
from comera_rec.rank.truncation import TruncationResult
from comera_rec.tensor.train import parameter_groups
from comera_rec.training.adamw import GroupStepAdamW

OPTIMIZERS = {
    "AdamW": GroupStepAdamW,  # torch's AdamW, its fused step per group (bit for bit the same)
    "Adam": torch.optim.Adam,
    "SGD": torch.optim.SGD,
    "Adagrad": torch.optim.Adagrad,
}
GROUPS = ("cores", "controllers", "other")
DECAYS = ("none", "linear", "cosine")


@dataclass
class OptimConfig:
    """The torch optimiser for TT cores, rank controllers and the remaining dense parameters."""

    name: str = "AdamW"
    """Optimiser class: "AdamW", "Adam", "SGD" or "Adagrad"."""
    lr_cores: float = 1e-4
    """Learning rate of the TT cores (reference 1e-4)."""
    lr_controllers: float = 1e-3
    """Learning rate of the rank controllers D (reference 1e-3)."""
    lr_other: float = 5e-5
    """Learning rate of every other trainable parameter (reference 5e-5)."""
    weight_decay: float = 0.0
    """Weight decay of every group (reference 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam / AdamW betas."""
    eps: float = 1e-8
    """Adam / AdamW / Adagrad epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0 to each group's rate (0: none)."""
    decay: str = "none"
    """After the warm-up, "none" (constant), "linear" or "cosine" decay to 0 at the last step."""
    clip_grad_norm: float = 0.0
    """Clip the global norm of the engine-optimised gradients to this before each step (0: off)."""
    fused: bool = True
    """Adam / AdamW: torch's fused kernel (one pass over each parameter and its state) instead of
    the multi-tensor (foreach) form; 2.6x faster on the compressed DLRM's many small tensors
    on CPU (docs/performance-history.md). Not with CUDA graphs, which use the capturable foreach form."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"OptimConfig.name must be one of {sorted(OPTIMIZERS)}, got {self.name!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"OptimConfig.decay must be one of {DECAYS}, got {self.decay!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.clip_grad_norm, (int, float)) or not 0 <= self.clip_grad_norm < math.inf:
            raise ValueError(f"OptimConfig.clip_grad_norm must be a finite number >= 0, got {self.clip_grad_norm!r}")
        for field_name in ("lr_cores", "lr_controllers", "lr_other", "weight_decay", "eps", "momentum"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ValueError(f"OptimConfig.{field_name} must be a finite number >= 0, got {value!r}")
        self.betas = tuple(self.betas)  # type: ignore[assignment]

    def group_lr(self, group: str) -> float:
        """Learning rate of a named group ("cores", "controllers" or "other")."""
        return {"cores": self.lr_cores, "controllers": self.lr_controllers, "other": self.lr_other}[group]

    def kwargs(self, capturable: bool = False) -> dict[str, object]:
        """Constructor arguments shared by all groups (learning rates are per group).

        Args:
            capturable: for a step captured in a CUDA graph: Adam / AdamW get
                ``capturable=True`` (step count and bias corrections on the device);
                SGD needs nothing; Adagrad cannot be captured (a ``ValueError``).

        Example::

            >>> OptimConfig(name="AdamW").kwargs(capturable=True)["capturable"]
            True
            >>> OptimConfig(name="AdamW").kwargs()["fused"]
            True
        """
        # foreach: one multi-tensor kernel per state instead of a Python loop over the many
        # small TT cores (torch only picks it by default on GPUs)
        kw: dict[str, object] = {"weight_decay": self.weight_decay, "foreach": True}
        if capturable and self.name == "Adagrad":
            raise ValueError(
                "OptimConfig: Adagrad has no capturable mode (its step count is read on the "
                "host); use Adam, AdamW or SGD with CUDA graphs"
            )
        if self.name in ("Adam", "AdamW"):
            kw.update(betas=self.betas, eps=self.eps)
            if capturable:
                kw.update(capturable=True)
            elif self.fused:
                del kw["foreach"]
                kw.update(fused=True)
        elif self.name == "Adagrad":
            kw.update(eps=self.eps)
        elif self.name == "SGD":
            kw.update(momentum=self.momentum)
        return kw


def lr_factor(config: OptimConfig, step: int, total_steps: Optional[int]) -> float:
    """Multiplier of every base learning rate at optimiser step ``step`` (0-based).

    Linear warm-up over ``warmup_steps`` (the first step already moves: factor
    ``1 / warmup_steps``), then the ``decay`` to 0 at ``total_steps``; without a known
    ``total_steps`` the rate stays constant after the warm-up.

    Example::

        >>> cfg = OptimConfig(warmup_steps=2, decay="linear")
        >>> [round(lr_factor(cfg, s, 6), 2) for s in range(6)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay == "none" or not total_steps or total_steps <= config.warmup_steps:
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / (total_steps - config.warmup_steps))
    if config.decay == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr_factor(optimizers: Iterable[object], factor: float) -> None:
    """Set every param group's ``lr`` to ``factor`` times its base rate.

    The base rate is the group's ``lr`` when first seen, kept in the group as
    ``"base_lr"`` (so it survives ``state_dict`` round trips and optimiser rebuilds
    start again from the configured rates). Objects without ``param_groups`` are
    left alone.
    """
    for opt in optimizers:
        for group in getattr(opt, "param_groups", ()):
            group.setdefault("base_lr", group["lr"])
            group["lr"] = group["base_lr"] * factor


def build_optimizer(
    model: nn.Module,
    config: OptimConfig,
    include: Optional[Iterable[nn.Parameter]] = None,
    capturable: bool = False,
) -> torch.optim.Optimizer:
    """One optimiser with a named param group per kind: cores, controllers, other.

    Args:
        model: the unwrapped model.
        config: optimiser settings.
        include: if given, only these parameters are optimised (e.g. leave out tables
            that TorchRec updates with a fused optimiser).
        capturable: build it for CUDA-graph capture (see :meth:`OptimConfig.kwargs`);
            torch requires the parameters on a GPU then.

    Returns:
        The optimiser; each group carries ``"name"``. Empty groups are left out.

    Example::

        >>> opt = build_optimizer(model, OptimConfig(name="AdamW"))  # doctest: +SKIP
        >>> [g["name"] for g in opt.param_groups]  # doctest: +SKIP
        ['cores', 'controllers', 'other']
    """
    allowed = None if include is None else {id(p) for p in include}
    groups = []
    for name, params in parameter_groups(model).items():
        params = [p for p in params if p.requires_grad and (allowed is None or id(p) in allowed)]
        if params:
            groups.append({"params": params, "lr": config.group_lr(name), "name": name})
    if not groups:
        raise ValueError("build_optimizer: the model has no trainable parameters to optimise")
    return OPTIMIZERS[config.name](groups, lr=config.lr_other, **config.kwargs(capturable))


def rebuild_optimizer(
    old: torch.optim.Optimizer,
    model: nn.Module,
    config: OptimConfig,
    truncation: Optional[TruncationResult] = None,
    include: Optional[Iterable[nn.Parameter]] = None,
    capturable: bool = False,
) -> torch.optim.Optimizer:
    """A new optimiser over ``model``'s current parameters, carrying ``old``'s state.

    Parameters that were not replaced keep their state; parameters replaced by a
    truncation get their old state sliced along the kept indices (or none when the
    indices are unknown). Group hyper-parameters (``lr`` and the rest, which a learning
    rate scheduler may have changed) are copied from the group of the same name.

    Args:
        old: the optimiser before the truncation.
        model: the unwrapped model, after the truncation.
        config: optimiser settings.
        truncation: what the truncation replaced (``RankSchedule.last_truncation``).
        include: as in :func:`build_optimizer`.
        capturable: as in :func:`build_optimizer`.

    Example::

        >>> if schedule.truncate(model):  # doctest: +SKIP
        ...     opt = rebuild_optimizer(opt, model, cfg, schedule.last_truncation)
    """
    new = build_optimizer(model, config, include, capturable)
    old_groups = {g.get("name"): g for g in old.param_groups}
    for group in new.param_groups:
        source = old_groups.get(group["name"])
        if source is None:
            continue
        for key, value in source.items():
            if key != "params":
                group[key] = value
    changes = truncation.by_old_id() if truncation is not None else {}
    by_new = {id(c.new): c for c in changes.values()}
    for group in new.param_groups:
        for p in group["params"]:
            change = by_new.get(id(p))
            if change is None:
                if p in old.state:
                    new.state[p] = dict(old.state[p])
            elif change.old in old.state and change.index:
                new.state[p] = sliced_state(old.state[change.old], change)
    return new
