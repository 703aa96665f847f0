"""Optimisers fused into backward (``apply_optimizer_in_backward``) around compressed modules.

TorchRec's examples give the embedding tables their optimiser before sharding::

    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.02})

The call marks each parameter (``_in_backward_optimizers``, ``_optimizer_classes``,
``_optimizer_kwargs``) and hooks its gradient accumulator. TorchRec's sharders read the
marks to build the fused table-batched kernels; the dense optimiser a user builds over
``in_backward_optimizer_filter(model.named_parameters())`` takes every parameter left
unmarked. Two things go wrong with compressed collections unless handled here:

* ``compress()`` after the call makes new parameters for the tables it keeps dense, and
  they would lose the marks: the sharder would then fuse its default (exact SGD), silently.
  :func:`carry_in_backward_optimizers` marks the new weight as the old one was.
* The TT cores and controllers are replicated (DDP), not sharded. A row-wise optimiser does
  not apply to a TT core (``RowWiseAdagrad`` on a ``(T, r, n, m, r')`` core fails on the
  shapes), and DDP runs the optimisers of marked replicated parameters in its own
  communication hook, which needs an accelerator stream (``Cannot access accelerator
  device`` on CPU). :func:`release_in_backward_optimizers` removes the marks and hooks
  from the TT parameters, with a warning naming them, before DDP wraps the model (a
  collection does it from ``Module._apply``, which ``DistributedModelParallel`` calls via
  ``.to(device)`` just before building DDP, and at its first forward). The TT parameters
  are then ordinary data-parallel parameters: the user's dense optimiser trains them, as it
  trains every replicated parameter in TorchRec's examples.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
from torch.distributed.optim.apply_optimizer_in_backward import (
    _apply_optimizer_in_backward,
    param_to_optim_hook_handle_map,
)

_MARKS = ("_in_backward_optimizers", "_optimizer_classes", "_optimizer_kwargs")


def in_backward_spec(param: torch.Tensor) -> list[tuple[type, dict[str, Any]]]:
    """The (optimiser class, kwargs) pairs ``apply_optimizer_in_backward`` put on ``param``.

    Example::

        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> _apply_optimizer_in_backward(torch.optim.SGD, [p], {"lr": 0.1})
        >>> in_backward_spec(p)
        [(<class 'torch.optim.sgd.SGD'>, {'lr': 0.1})]
    """
    return list(zip(getattr(param, "_optimizer_classes", []), getattr(param, "_optimizer_kwargs", [])))


def carry_in_backward_optimizers(source: torch.Tensor, target: torch.nn.Parameter) -> None:
    """Give ``target`` the in-backward optimisers of ``source`` (a parameter it replaces).

    Args:
        source: the parameter being replaced.
        target: its replacement (same role, e.g. the same table's weight in a new module).
    """
    with torch.enable_grad():  # the hook goes on the gradient accumulator (compress runs under no_grad)
        for cls, kwargs in in_backward_spec(source):
            _apply_optimizer_in_backward(cls, [target], dict(kwargs))


def release_in_backward_optimizers(named_params: Iterable[tuple[str, torch.nn.Parameter]], owner: str) -> list[str]:
    """Take the in-backward optimisers off ``named_params`` (marks and gradient hooks).

    Args:
        named_params: the parameters that must stay plain data-parallel ones (TT cores and
            controllers).
        owner: the module's name for the warning.

    Returns:
        The names of the parameters released (empty when none was marked). A
        ``UserWarning`` names them and their optimisers.
    """
    released: list[str] = []
    classes: set[str] = set()
    for name, p in named_params:
        if not hasattr(p, "_in_backward_optimizers"):
            continue
        classes.update(cls.__name__ for cls, _ in in_backward_spec(p))
        for handle in param_to_optim_hook_handle_map.pop(p, []):
            handle.remove()
        for mark in _MARKS:
            if hasattr(p, mark):
                delattr(p, mark)
        released.append(name)
    if released:
        warnings.warn(
            f"{owner}: apply_optimizer_in_backward({', '.join(sorted(classes))}) does not apply to TT parameters "
            f"({', '.join(released)}): they are replicated under DDP, not sharded, and are left to the dense "
            "optimiser (the one built over in_backward_optimizer_filter(model.named_parameters())); "
            "see docs/torchrec.md",
            UserWarning,
            stacklevel=3,
        )
    return released
