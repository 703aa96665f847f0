"""Physical rank truncation over a whole model, remembering which slices were kept.

:meth:`TensorTrainModule.truncate_ranks` replaces the cut cores and controllers by new
parameters. Optimiser state (Adam moments, Adagrad sums) lives on the old ones; to carry
it over, the trainer needs, for every replaced parameter, the new parameter and the
kept indices along each cut dimension. :func:`truncate_model` records them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from comera_rec.tensor.train import TensorTrainModule, tensor_train_modules


@dataclass
class ParameterChange:
    """One parameter replaced by truncation.

    Attributes:
        old: the parameter before truncation.
        new: the parameter that replaced it.
        index: ``{dim: kept indices}``; slicing ``old`` along each dim gives ``new``'s
            shape. Empty when the kept indices are unknown (state must be reset).
    """

    old: nn.Parameter
    new: nn.Parameter
    index: dict[int, torch.Tensor] = field(default_factory=dict)

    def slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """Apply the recorded cut to a tensor shaped like ``old`` (e.g. ``exp_avg``)."""
        for dim, idx in self.index.items():
            tensor = tensor.index_select(dim, idx.to(tensor.device))
        return tensor.contiguous()


@dataclass
class TruncationResult:
    """What one truncation event did.

    Attributes:
        changed: True if any rank fell (parameters were replaced).
        changes: one entry per replaced parameter.
        ranks_before: physical ranks per module before the cut.
        ranks_after: physical ranks per module after the cut.
    """

    changed: bool
    changes: list[ParameterChange]
    ranks_before: dict[str, list[int]]
    ranks_after: dict[str, list[int]]

    def by_old_id(self) -> dict[int, ParameterChange]:
        """Changes keyed by ``id(old parameter)``."""
        return {id(c.old): c for c in self.changes}


def _truncate_module(module: TensorTrainModule, threshold: float) -> list[ParameterChange]:
    kept = module.kept_indices(threshold)
    old_cores = list(module.cores)
    old_ctrls = list(module.controllers)
    if not module.truncate_ranks(threshold):
        return []
    changes: list[ParameterChange] = []
    num_bonds = len(old_ctrls)
    for k, (old, new) in enumerate(zip(old_ctrls, module.controllers)):
        if old is not new:
            changes.append(ParameterChange(old, new, {old.dim() - 1: kept[k]}))
    for k, (old, new) in enumerate(zip(old_cores, module.cores)):
        if old is new:
            continue
        batch_dims = old_ctrls[0].dim() - 1  # controllers are (*batch, r)
        index: dict[int, torch.Tensor] = {}
        if k > 0 and len(kept[k - 1]) != old.shape[batch_dims]:
            index[batch_dims] = kept[k - 1]
        if k < num_bonds and len(kept[k]) != old.shape[-1]:
            index[old.dim() - 1] = kept[k]
        changes.append(ParameterChange(old, new, index))
    return changes


def truncate_model(model: nn.Module, threshold: float) -> TruncationResult:
    """Cut the dead ranks of every TT module of ``model``.

    Args:
        model: the unwrapped model (not the DDP wrapper).
        threshold: controller magnitude below which a rank slice is dead.

    Returns:
        A :class:`TruncationResult`; when ``changed`` is True rebuild the DDP wrapper and
        the optimisers (see ``comera_rec.training.optim.rebuild_optimizer``).

    Example::

        >>> layer = TTLinear(16, 8, rank=4)
        >>> with torch.no_grad():
        ...     layer.controllers[0][1:] = 0.0
        >>> truncate_model(layer, 1e-2).ranks_after
        {'': [1, 4, 4]}
    """
    before = {name: m.ranks for name, m in tensor_train_modules(model)}
    changes: list[ParameterChange] = []
    for _, module in tensor_train_modules(model):
        changes.extend(_truncate_module(module, threshold))
    after = {name: m.ranks for name, m in tensor_train_modules(model)}
    return TruncationResult(bool(changes), changes, before, after)


@torch.no_grad()
def resize_to_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> bool:
    """Give every TT core and controller the shape it has in ``state_dict``.

    A checkpoint taken after truncation holds smaller cores than a freshly built model;
    call this before ``model.load_state_dict``. The new parameters are uninitialised
    (``torch.empty``): loading the state fills them.

    Args:
        model: the unwrapped model.
        state_dict: a state dict of the same model, possibly at lower ranks.

    Returns:
        True if any parameter was replaced.

    Example::

        >>> small = TTLinear(16, 8, rank=2); big = TTLinear(16, 8, rank=4)
        >>> resize_to_state_dict(big, small.state_dict()); big.ranks
        True
        [2, 2, 2]
    """
    changed = False
    for name, module in tensor_train_modules(model):
        prefix = f"{name}." if name else ""
        for list_name in ("cores", "controllers"):
            plist: nn.ParameterList = getattr(module, list_name)
            for k, p in enumerate(plist):
                key = f"{prefix}{list_name}.{k}"
                if key not in state_dict:
                    raise KeyError(f"resize_to_state_dict: {key!r} missing from the state dict")
                shape = tuple(state_dict[key].shape)
                if tuple(p.shape) != shape:
                    plist[k] = nn.Parameter(
                        torch.empty(shape, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad
                    )
                    changed = True
    return changed


def tt_rank_dims(model: nn.Module) -> dict[str, set[int]]:
    """State-dict key of every TT core / controller -> its dims that are TT ranks."""
    out: dict[str, set[int]] = {}
    for name, module in tensor_train_modules(model):
        prefix = f"{name}." if name else ""
        batch_dims = module.controllers[0].dim() - 1 if len(module.controllers) else 0
        for k, core in enumerate(module.cores):
            out[f"{prefix}cores.{k}"] = {batch_dims, core.dim() - 1}
        for k, ctrl in enumerate(module.controllers):
            out[f"{prefix}controllers.{k}"] = {ctrl.dim() - 1}
    return out
