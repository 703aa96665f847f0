"""What the compressed step's fixed costs are worth (:mod:`comera_rec.dlrm.bench`,
``--fixed-costs``): a compressed model's training step against copies of the model with one
cost taken away, the copies' steps alternating with the model's in one process.

The costs are those that do not shrink with the kernels' arithmetic: the TT layers' chain
merges (cores and controllers into ``left`` / ``right``, forward and backward, with their
autograd nodes and the gradients of every core and controller), the controllers folded into
the TTM tables' cores, and the optimizer's step. A copy without one of them trains wrongly
(its chains stay at their first values, its tables ignore their controllers, or it never
updates), so each figure is a bound on what making that cost cheaper could gain, not the
result of such a change. Used to choose the next lever: docs/performance-history.md.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import Callable

import torch
from torch import nn

from comera_rec.dlrm.bench_setup import Setup, build, model_config, train_batches, train_step, use_lookup_path
from comera_rec.tensor.linear import TTLinear
from comera_rec.tensor.train import tensor_train_modules
from comera_rec.utils.host import freeze_live_objects, keep_freed_memory

REMOVALS = ("merges", "folds", "optimizer")
"""The costs a copy goes without, one each: ``merges``, the TT layers' chains merged once and
then kept as fixed leaf tensors; ``folds``, the TTM tables' cores used without their
controllers; ``optimizer``, no optimizer step (gradients still computed and cleared)."""


@torch.no_grad()
def fix_merges(model: nn.Module) -> int:
    """Merge every TT layer's chains once and let the layer train on those two tensors from
    then on (leaf tensors with gradients of their own, which no optimizer updates): no
    merge forward or backward, no core or controller gradient of the TT layers.

    Returns:
        The number of TT layers changed.
    """
    layers = [m for m in model.modules() if isinstance(m, TTLinear)]
    for layer in layers:
        left, right = (t.detach().clone().requires_grad_() for t in layer.chains())

        def fixed_operands(self: TTLinear, like: torch.Tensor, left=left, right=right) -> tuple:
            return left, right, self.bias, self.relu

        layer.chain_operands = types.MethodType(fixed_operands, layer)
    return len(layers)


def skip_folds(model: nn.Module) -> int:
    """Let every tensor-train module but the TT layers (the TTM tables) use its cores as they
    are, its controllers not folded in (they then get no gradient).

    Returns:
        The number of modules changed.
    """
    changed = 0
    for _, module in tensor_train_modules(model):
        if isinstance(module, TTLinear):
            continue
        module._fold_controllers = types.MethodType(lambda self, skip=None: list(self.cores), module)
        if hasattr(module, "training_operands"):  # a stack's lookup: no middle controller either
            module.training_operands = types.MethodType(lambda self: (list(self.cores), None), module)
        changed += 1
    return changed


def _step_without_optimizer(wrapped: nn.Module, optimizer: torch.optim.Optimizer, batch) -> float:
    loss, _ = wrapped(batch)
    loss.backward()
    optimizer.zero_grad()
    return float(loss.detach())


def fixed_cost_times(setup: Setup, variant: str = "tt", steps: int = 50, warmup: int = 20) -> dict[str, float]:
    """Median step seconds of ``variant`` (``"model"``) and of one copy per entry of
    :data:`REMOVALS`, all built from the same seed, each step's batch run by every one of
    them in a rotating order (so that none always follows the same one).

    Args:
        setup: the benchmark's shapes (its batch size, rank and malloc setting).
        variant: a compressed variant (``"tt"``, ``"tt_half"``).
        steps: timed steps, each on a batch of its own.
        warmup: untimed steps first.
    """
    if not model_config(variant, setup, mlperf=False).compressed:
        raise ValueError(f"fixed costs of {variant!r}: a dense model has no merges or folds (tt, tt_half)")
    if setup.keep_freed_memory:
        keep_freed_memory()
    use_lookup_path(variant)
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer, Callable]] = {}
    for name in ("model", *REMOVALS):
        wrapped, optimizer = build(variant, setup, mlperf=False)
        if name == "merges" and fix_merges(wrapped) == 0:
            raise ValueError(f"--fixed-costs {variant}: the model has no TT layer")
        if name == "folds" and skip_folds(wrapped) == 0:
            raise ValueError(f"--fixed-costs {variant}: the model has no TTM table")
        runs[name] = (wrapped, optimizer, _step_without_optimizer if name == "optimizer" else train_step)
    data = train_batches(setup, False, warmup + steps)
    freeze_live_objects()
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i, batch in enumerate(data):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            wrapped, optimizer, step = runs[name]
            start = time.perf_counter()
            step(wrapped, optimizer, batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def fixed_costs(setup: Setup, variant: str = "tt", steps: int = 50, warmup: int = 20) -> dict[str, float]:
    """Print :func:`fixed_cost_times` as a table: each copy's step and what it saves against
    the model's. Returns the times."""
    times = fixed_cost_times(setup, variant, steps, warmup)
    model = times["model"]
    print(
        f"{variant}: the step with one fixed cost taken away (median of {steps} steps, all copies in one "
        f"process, batch {setup.batch_size}); a copy trains wrongly, so each saving is a bound, not a result"
    )
    print(f"{'copy':12s} {'step ms':>8s} {'saves ms':>9s} {'share':>6s}")
    for name, seconds in times.items():
        saved = model - seconds
        print(f"{name:12s} {seconds * 1e3:8.2f} {saved * 1e3:9.2f} {saved / model:6.1%}")
    return times
