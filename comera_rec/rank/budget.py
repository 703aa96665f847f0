"""Budgeted rank adaptation: reach a size target by cutting the rank slices that cost the
least loss per byte.

The reference schedule steers the size only through ``gamma`` (the weight of the L1 norm
of the rank controllers) and cuts a slice once its controller falls below ``tau``. That
has two faults, measured on the DLRM demo (docs/rank.md): the size reached depends on
``gamma`` in a way no user can predict, and the cut is not scale-aware (a controller can
shrink while its cores grow to compensate, so a slice below ``tau`` may still carry
signal, and cutting it costs accuracy).

Here the size follows a plan instead. Between ``start`` and ``end`` (steps) the planned
size falls from the starting size ``S_start`` to the target ``S0`` along a cubic
(fast first, slow near the target, as in gradual magnitude pruning)::

    S_plan(t) = S0 + (S_start - S0) * (1 - (t - start) / (end - start)) ** 3

At each cut event the slices whose removal costs least per byte are cut until the live
size is at most ``S_plan(t)``. The cost of cutting slice ``j`` of bond ``k`` is the
second-order estimate of the loss change when its controller ``D_kj`` is set to 0, with
the empirical Fisher in place of the Hessian::

    cost_kj ~ 1/2 * E[(D_kj * dL/dD_kj) ** 2]

accumulated over the steps since the last event from the task-loss gradient alone. It is
invariant to the scale exchange between a controller and its cores (``D -> D / c``,
``G -> c G`` leaves ``D * dL/dD`` unchanged), it is in units of loss, so slices of
different modules (tables and MLP layers) compare directly, and dividing it by the bytes a
slice holds (which depend on the neighbouring ranks) cuts where the bytes are cheapest.
No size term is added to the loss (an L1 pressure on the controllers, weighted by the
bytes of each slice, was tried and cost accuracy: docs/rank.md). The rank controllers are
still what the cut acts on: a chosen slice has its controller
set to 0 and :func:`~comera_rec.rank.truncation.truncate_model` removes it, with the
optimiser state sliced as for any truncation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from comera_rec.tensor.train import TensorTrainModule, tensor_train_modules

FLOOR_RULES = ("keep", "until")  # how a module floor stops the cuts (SliceImportance.select)


def planned_size(step: int, start: int, end: int, size_start: float, size_target: float) -> float:
    """The size (core entries) the plan asks for after ``step`` optimiser steps.

    Args:
        step: optimiser steps taken.
        start: first step of the cutting window (the plan is ``size_start`` before it).
        end: last step of the window (the plan is ``size_target`` from it on).
        size_start: the live size when the run started.
        size_target: S0.

    Example::

        >>> [round(planned_size(s, 0, 10, 100.0, 20.0)) for s in (0, 5, 10, 20)]
        [100, 30, 20, 20]
    """
    if step <= start:
        return float(size_start)
    if step >= end:
        return float(size_target)
    left = 1.0 - (step - start) / max(1, end - start)
    return float(size_target) + (float(size_start) - float(size_target)) * left**3


def bond_slice_entries(module: TensorTrainModule, live_ranks: list[int]) -> list[int]:
    """Core entries one slice of each bond holds at ``live_ranks``, over all stacked trains
    (:meth:`~comera_rec.tensor.train.TensorTrainModule.slice_sizes`).

    Example::

        >>> from comera_rec.tensor import TTLinear
        >>> layer = TTLinear(16, 8, rank=4)
        >>> [tuple(c.shape) for c in layer.cores]
        [(1, 4, 4), (4, 4, 4), (4, 2, 4), (4, 4, 1)]
        >>> bond_slice_entries(layer, layer.live_ranks())  # 4*1 + 4*4, 4*4 + 2*4, 2*4 + 4*1
        [20, 24, 12]
    """
    return module.slice_sizes(live_ranks)


@dataclass
class Cut:
    """One slice chosen for removal."""

    module: str
    bond: int
    slice: int
    cost: float
    entries: int


class SliceImportance:
    """Accumulates the Fisher cost ``(D * dL/dD) ** 2`` of every rank slice between cut events.

    Call :meth:`observe` after each backward (gradients all-reduced, so every process
    holds the same costs and chooses the same cuts), :meth:`select` at a cut event, then
    :meth:`reset` once the cut has been made (the shapes change).

    Args:
        threshold: controller magnitude below which a slice is dead.

    Example::

        >>> from comera_rec.tensor import TTLinear
        >>> layer = TTLinear(16, 8, rank=4)
        >>> layer(torch.randn(5, 16)).pow(2).sum().backward()
        >>> scores = SliceImportance(threshold=1e-2); scores.observe(layer)
        >>> scores.steps
        1
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.costs: dict[tuple[str, int], torch.Tensor] = {}
        self.steps = 0

    @torch.no_grad()
    def observe(self, model: nn.Module) -> None:
        """Add this step's costs from the controllers' gradients (of the task loss: the
        budget schedule adds no size term to the objective).

        Args:
            model: the unwrapped model, its controllers' ``.grad`` set by the backward.
        """
        seen = False
        for name, m in tensor_train_modules(model):
            for k, d in enumerate(m.controllers):
                if d.grad is not None:
                    self.observe_controller(name, k, d)
                    seen = True
        if seen:
            self.steps += 1

    @torch.no_grad()
    def observe_controller(self, name: str, bond: int, controller: torch.Tensor) -> None:
        """Add one controller's cost from its ``.grad`` (the step is counted by the caller:
        :class:`~comera_rec.integration.adapter.RankAdapter` calls this from a gradient hook).

        Args:
            name: the TT module's name in the model.
            bond: the controller's bond index.
            controller: the controller parameter, its ``.grad`` set.
        """
        g = controller.grad
        g = g.to_dense() if g.is_sparse else g
        cost = (controller * g).float().pow(2)
        while cost.dim() > 1:  # stacked trains: a slice is cut from every train
            cost = cost.sum(dim=0)
        key = (name, bond)
        prev = self.costs.get(key)
        self.costs[key] = cost if prev is None or prev.shape != cost.shape else prev + cost

    @torch.no_grad()
    def all_reduce(self, model: nn.Module) -> None:
        """Sum the costs over all processes (every bond of ``model``, in one fixed order), so
        that costs gathered from local gradients give every process the same cuts; a no-op
        without a process group."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        keys, flat = [], []
        for name, m in tensor_train_modules(model):
            for k, d in enumerate(m.controllers):
                rank = d.shape[-1]
                cost = self.costs.get((name, k))
                flat.append(cost.cpu() if cost is not None and cost.shape == (rank,) else torch.zeros(rank))
                keys.append((name, k))
        if not flat:
            return
        buffer = torch.cat(flat).to(torch.float64)
        if dist.get_backend() == "nccl":  # nccl reduces device tensors only
            buffer = buffer.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(buffer)
        buffer = buffer.cpu()
        for key, part in zip(keys, buffer.split([t.numel() for t in flat])):
            self.costs[key] = part.float()

    def reset(self) -> None:
        """Forget the costs (after a cut: the slices and their indices change)."""
        self.costs.clear()
        self.steps = 0

    @torch.no_grad()
    def select(
        self,
        model: nn.Module,
        target_entries: float,
        floor_entries: float = 0.0,
        entry_exponent: float = 1.0,
        module_floors: Optional[dict[str, float]] = None,
        floor_rule: str = "keep",
    ) -> list[Cut]:
        """The slices to cut so that the live size is at most ``target_entries``.

        Greedy: repeatedly the live slice of least cost per entry freed, on a bond that keeps
        at least one slice; the entries a slice frees are recomputed as ranks fall. The last
        cut, when the cheapest per entry would overshoot, is the least costly of those that
        reach the target. Slices
        already dead (below the threshold) are cut by the truncation anyway and are counted
        as gone.

        Args:
            model: the unwrapped model.
            target_entries: the size (core entries) to reach.
            floor_entries: no cut may take the size below this (the schedule passes a little
                under its final target, so that one large slice cannot overshoot it).
            entry_exponent: slices are ranked by cost / entries ** entry_exponent (1: loss
                per entry freed).
            module_floors: per module name, a size (entries): with ``floor_rule="keep"`` no
                cut takes the module below it; with ``"until"`` the module is cut only while
                it is above it (so it ends at most one slice under: the target stays
                reachable however coarse the module's slices are).
            floor_rule: ``"keep"`` or ``"until"`` (above).

        Returns:
            The cuts, in the order chosen (empty when the size is already within target).
        """
        modules = dict(tensor_train_modules(model))
        live = {name: m.live_ranks(self.threshold) for name, m in modules.items()}
        module_size = {name: float(m.tt_size(self.threshold)) for name, m in modules.items()}
        size = float(sum(module_size.values()))
        if size <= target_entries:
            return []
        if floor_rule not in FLOOR_RULES:
            raise ValueError(f"SliceImportance.select: floor_rule must be one of {FLOOR_RULES}, got {floor_rule!r}")
        floors = module_floors or {}
        # per bond: its live slices sorted by cost (cheapest first)
        queues: dict[tuple[str, int], list[tuple[float, int]]] = {}
        for name, m in modules.items():
            for k in range(len(m.controllers)):
                alive = m.live_mask(k, self.threshold)
                cost = self.costs.get((name, k))
                if cost is None or cost.shape != alive.shape:
                    cost = torch.zeros(alive.shape)
                cost = cost.to("cpu", torch.float64) / max(1, self.steps)
                idx = alive.nonzero().flatten().tolist()
                queues[(name, k)] = sorted((float(cost[j]), j) for j in idx)
        cuts: list[Cut] = []
        while size > target_entries:
            best: Optional[tuple[float, str, int, int]] = None
            finish: Optional[tuple[float, str, int, int]] = None  # cheapest single cut that reaches the target
            for (name, k), queue in queues.items():
                if live[name][k] <= 1 or not queue:
                    continue
                entries = bond_slice_entries(modules[name], live[name])[k]
                if size - entries < floor_entries:
                    continue
                module_floor = floors.get(name)
                if module_floor is not None:
                    if floor_rule == "until":  # cut only while still above the floor
                        blocked = module_size[name] <= module_floor
                    else:  # never below the floor
                        blocked = module_size[name] - entries < module_floor
                    if blocked:
                        continue
                value = queue[0][0] / max(entries, 1) ** entry_exponent
                if best is None or value < best[0]:
                    best = (value, name, k, entries)
                if size - entries <= target_entries and (finish is None or queue[0][0] < finish[0]):
                    finish = (queue[0][0], name, k, entries)
            if best is None:
                break  # every bond is at rank 1, or every cut left would pass the floor
            if finish is not None and size - best[3] < target_entries:
                # the cheapest per entry would overshoot: the last cut is the one of least cost
                # among those that reach the target (usually a smaller slice, less overshoot)
                best = finish
            _, name, k, entries = best
            cost, j = queues[(name, k)].pop(0)
            cuts.append(Cut(name, k, j, cost, entries))
            live[name][k] -= 1
            size -= entries
            module_size[name] -= entries
        return cuts


@torch.no_grad()
def apply_cuts(model: nn.Module, cuts: list[Cut]) -> None:
    """Set the controllers of the chosen slices to 0 (in every stacked train); a following
    ``truncate_model(model, threshold)`` removes them from the cores."""
    modules = dict(tensor_train_modules(model))
    for cut in cuts:
        modules[cut.module].controllers[cut.bond][..., cut.slice] = 0.0


def cut_plan_steps(start: int, end: int, num_cuts: int) -> list[int]:
    """The steps of ``num_cuts`` cut events spread evenly over ``(start, end]``.

    Example::

        >>> cut_plan_steps(100, 500, 4)
        [200, 300, 400, 500]
    """
    if num_cuts < 1 or end <= start:
        return [max(end, 1)]
    return sorted({max(1, start + math.ceil((end - start) * (i + 1) / num_cuts)) for i in range(num_cuts)})
