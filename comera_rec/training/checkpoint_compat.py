"""Whether a checkpoint fits this run: config differences and state-dict mismatches.

The trainer refuses a resume whose model does not fit (:class:`IncompatibleCheckpointError`);
``dlrm/predict.py`` uses the same checks before it loads a checkpoint for scoring.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from comera_rec.tensor.train import tensor_train_modules


class IncompatibleCheckpointError(ValueError):
    """A checkpoint was written by a run whose model does not fit this one."""


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for k, v in config.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: config}


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def config_differences(saved: Any, current: Any, ignore: tuple[str, ...] = ("trainer.",)) -> list[str]:
    """``key (checkpoint X, now Y)`` for every config key whose value differs.

    Args:
        saved: the config dict stored in a checkpoint's meta.json.
        current: this run's config dict.
        ignore: key prefixes that may change between a run and its resumption.
    """
    a, b = _flatten(saved or {}), _flatten(current or {})
    keys = sorted(set(a) | set(b))
    return [
        f"{k} (checkpoint {_short(a.get(k, '<absent>'))}, now {_short(b.get(k, '<absent>'))})"
        for k in keys
        if not k.startswith(ignore) and a.get(k, "<absent>") != b.get(k, "<absent>")
    ]


def _rank_dims(model: nn.Module) -> dict[str, set[int]]:
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


def state_dict_mismatches(model: nn.Module, saved: dict[str, Any]) -> list[str]:
    """How ``saved`` fails to fit ``model``: missing / unexpected keys and shape mismatches.

    TT cores and controllers may differ in their rank dimensions (a checkpoint taken
    after truncation); every other dimension must match.
    """
    current = model.state_dict()
    rank_dims = _rank_dims(model)
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
