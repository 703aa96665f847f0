"""Point any optimiser at the parameters a rank truncation made, with its state sliced.

A truncation replaces each cut core and controller by a smaller ``nn.Parameter``
(:class:`~comera_rec.rank.truncation.TruncationResult`). An optimiser built before it
still holds the old parameters and their state. :func:`retarget_optimizer` fixes it in
place, whatever the optimiser is:

* a ``torch.optim.Optimizer``: each old parameter in its ``param_groups`` becomes the new
  one, and its state (``exp_avg``, ``exp_avg_sq``, Adagrad's ``sum``, ``momentum_buffer``:
  every tensor shaped like the parameter) is sliced along the kept rank indices; scalar
  state (``step``) is kept;
* a TorchRec ``KeyedOptimizer`` / ``KeyedOptimizerWrapper`` (its ``params`` mapping, and
  the ``state`` / ``param_groups`` it shares with the optimiser inside);
* a ``CombinedOptimizer`` (each of its ``optimizers``).

TorchRec is not imported: the keyed kinds are recognised by their attributes, so the rank
layer stays below the integration layer.
"""

from __future__ import annotations

from typing import Any

import torch

from comera_rec.rank.truncation import ParameterChange, TruncationResult


def sliced_state(state: dict[str, Any], change: ParameterChange) -> dict[str, Any]:
    """``state`` (an optimiser's state of ``change.old``) for ``change.new``: every tensor
    shaped like the old parameter sliced to the kept indices, the rest (``step``) kept;
    empty when the kept indices are unknown (the state starts afresh)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == change.old.shape:
            if not change.index:
                return {}  # kept indices unknown: the state starts afresh
            out[key] = change.slice(value)
        else:
            out[key] = value
    return out


def _retarget_one(opt: Any, changes: dict[int, ParameterChange]) -> int:
    moved = 0
    for group in getattr(opt, "param_groups", ()):
        params = group["params"]
        for i, p in enumerate(params):
            change = changes.get(id(p))
            if change is not None:
                params[i] = change.new
                moved += 1
    state = getattr(opt, "state", None)
    if isinstance(state, dict):
        for change in changes.values():
            if change.old in state:
                old_state = state.pop(change.old)
                new_state = sliced_state(old_state, change)
                if new_state:
                    state[change.new] = new_state
    keyed = getattr(opt, "params", None)  # KeyedOptimizer: fully qualified name -> parameter
    if isinstance(keyed, dict):
        for name, p in list(keyed.items()):
            change = changes.get(id(p))
            if change is not None:
                keyed[name] = change.new
    return moved


def retarget_optimizer(optimizer: Any, truncation: TruncationResult) -> int:
    """Make ``optimizer`` (and every optimiser inside it) use the truncated parameters.

    Args:
        optimizer: a ``torch.optim.Optimizer``, a TorchRec ``KeyedOptimizer``,
            ``KeyedOptimizerWrapper`` or ``CombinedOptimizer``, or a list / tuple of them.
        truncation: what the truncation replaced.

    Returns:
        How many parameter slots were pointed at a new parameter.

    Example::

        >>> from comera_rec.tensor import TTLinear
        >>> from comera_rec.rank.truncation import truncate_model
        >>> layer = TTLinear(16, 8, rank=4)
        >>> opt = torch.optim.Adam(layer.parameters())
        >>> layer(torch.randn(2, 16)).sum().backward(); opt.step()
        >>> with torch.no_grad():
        ...     layer.controllers[0][2:] = 0.0
        >>> retarget_optimizer(opt, truncate_model(layer, 1e-2))  # controller 0, cores 0 and 1
        3
        >>> opt.state[layer.cores[0]]["exp_avg"].shape
        torch.Size([1, 4, 2])
    """
    changes = truncation.by_old_id()
    if not changes:
        return 0
    moved, seen = 0, set()
    pending = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    while pending:
        opt = pending.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        if _is_combined(opt):  # its state is a merged copy: retarget the optimisers it holds
            pending.extend(item[1] if isinstance(item, tuple) else item for item in opt.optimizers)
            continue
        moved += _retarget_one(opt, changes)
    return moved


def _is_combined(opt: Any) -> bool:
    """A TorchRec ``CombinedOptimizer`` (``optimizers``: a list of (prefix, optimiser))."""
    return type(opt).__name__ == "CombinedOptimizer" and isinstance(getattr(opt, "optimizers", None), (list, tuple))
