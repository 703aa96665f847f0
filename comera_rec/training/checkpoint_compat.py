"""Whether a checkpoint fits this run: config differences and state-dict mismatches.

The trainer refuses a resume whose model does not fit (:class:`IncompatibleCheckpointError`);
``dlrm/predict.py`` uses the same checks before it loads a checkpoint for scoring.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from comera_rec.config import config_differences, flatten_config, short_repr  # noqa: F401  (re-exported)
from comera_rec.rank.truncation import tt_rank_dims


class IncompatibleCheckpointError(ValueError):
    """A checkpoint was written by a run whose model does not fit this one."""


def state_dict_mismatches(model: nn.Module, saved: dict[str, Any]) -> list[str]:
    """How ``saved`` fails to fit ``model``: missing / unexpected keys and shape mismatches.

    TT cores and controllers may differ in their rank dimensions (a checkpoint taken
    after truncation); every other dimension must match.
    """
    current = model.state_dict()
    rank_dims = tt_rank_dims(model)
    problems: list[str] = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"missing from the checkpoint: {missing[:10]}" + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        problems.append(f"not in the model: {unexpected[:10]}" + (" ..." if len(unexpected) > 10 else ""))
    for key, tensor in current.items():
        if key not in saved or not hasattr(tensor, "shape") or not hasattr(saved[key], "shape"):
            continue
        a, b = tuple(saved[key].shape), tuple(tensor.shape)
        if a == b:
            continue
        dims = rank_dims.get(key)
        if dims is not None and len(a) == len(b) and all(x == y for i, (x, y) in enumerate(zip(a, b)) if i not in dims):
            continue
        problems.append(f"{key}: shape {list(a)} in the checkpoint, {list(b)} in the model")
    return problems
