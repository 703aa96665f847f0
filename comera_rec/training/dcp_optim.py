"""Optimiser state under stable names, and row-wise state across table sharding plans.

A torch optimiser keys its state by parameter index and TorchRec's fused optimiser by a
name that differs between one process and DMP: :func:`optimizer_state` /
:func:`keyed_optimizer_state` key both by the model's state-dict names.
:func:`convert_rowwise` maps TorchRec's row-wise accumulators from one column sharding to
another. Re-exported by :mod:`comera_rec.training.dcp_state`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from comera_rec.training.checkpoint_shards import sharded_tensor_type


# ---------------------------------------------------------------------------- optimisers
def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its name in ``model`` (a shared parameter: its last name)."""
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def optimizer_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """A torch optimiser's state keyed by parameter name instead of index.

    Args:
        opt: the optimiser (its parameters belong to ``model``).
        model: the unwrapped model that names the parameters.

    Returns:
        ``{"state": {name: {state name: value}}, "param_groups": [...], "names": [names in
        index order]}``; a parameter the model does not hold keeps its index as its name.
    """
    names = param_names(model)
    ordered = [names.get(id(p), f"#{i}") for i, p in enumerate(p for g in opt.param_groups for p in g["params"])]
    sd = opt.state_dict()
    return {
        "state": {ordered[int(i)]: dict(s) for i, s in sd["state"].items()},
        "param_groups": sd["param_groups"],
        "names": ordered,
    }


def load_optimizer_state(opt: torch.optim.Optimizer, model: nn.Module, saved: dict[str, Any]) -> None:
    """Load :func:`optimizer_state`'s output into ``opt``, matching parameters by name.

    Hyperparameters (learning rate, betas, ...) come from the saved groups, parameters from
    ``opt``'s own.

    Raises:
        ValueError: the groups differ in number, or a saved parameter name is not in ``opt``.
    """
    live = optimizer_state(opt, model)
    index = {name: i for i, name in enumerate(live["names"])}
    unknown = [n for n in saved["state"] if n not in index]
    if unknown:
        raise ValueError(f"optimiser state of {unknown[:5]} has no parameter of that name in this model")
    if len(saved["param_groups"]) != len(live["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimiser has {len(saved['param_groups'])} parameter groups, this one "
            f"{len(live['param_groups'])}"
        )
    groups = [dict(s, params=g["params"]) for s, g in zip(saved["param_groups"], live["param_groups"])]
    opt.load_state_dict({"state": {index[n]: s for n, s in saved["state"].items()}, "param_groups": groups})


def suffix_index(model_keys: Iterable[str]) -> dict[str, list[str]]:
    """Model keys by their last two name parts (``t_cat_2.weight``)."""
    index: dict[str, list[str]] = {}
    for k in model_keys:
        index.setdefault(".".join(k.split(".")[-2:]), []).append(k)
    return index


def model_key(key: str, model_keys: set[str], suffixes: dict[str, list[str]]) -> str:
    """The model state-dict key a fused optimiser names ``key``: itself, or the one key
    that ends with it (one process's fused tables use the table's own name)."""
    if key in model_keys:
        return key
    found = [k for k in suffixes.get(".".join(key.split(".")[-2:]), []) if k.endswith("." + key)]
    return found[0] if len(found) == 1 else key


def state_name(name: str) -> str:
    """``t_cat_2.weight.momentum_1`` and ``t_cat_2.momentum1`` -> ``momentum1``."""
    return str(name).rsplit(".", 1)[-1].replace("_", "")


def keyed_optimizer_state(sd: dict[str, Any], model_keys: Iterable[str]) -> dict[str, Any]:
    """A TorchRec (keyed) optimiser's state dict with stable names.

    Args:
        sd: the optimiser's ``state_dict()``.
        model_keys: the unwrapped model's state-dict keys.

    Returns:
        ``{"state": {model key of the table: {state name: tensor}}, "param_groups": [...]}``:
        each state name is its last part with underscores dropped (``t_cat_2.weight.momentum_1``
        and ``t_cat_2.momentum1`` both become ``momentum1``); the groups are kept for their
        hyperparameters.
    """
    keys = set(model_keys)
    suffixes = suffix_index(keys)
    state = {
        model_key(str(pkey), keys, suffixes): {state_name(s): v for s, v in entries.items()}
        for pkey, entries in sd.get("state", {}).items()
    }
    return {"state": state, "param_groups": sd.get("param_groups", [])}


def keyed_locations(sd: dict[str, Any], model_keys: Iterable[str]) -> dict[tuple[str, str], tuple[Any, Any]]:
    """(stable table key, stable state name) -> (the optimiser's param key, its state name)."""
    keys = set(model_keys)
    suffixes = suffix_index(keys)
    return {
        (model_key(str(pkey), keys, suffixes), state_name(s)): (pkey, s)
        for pkey, entries in sd.get("state", {}).items()
        for s in entries
    }


def load_keyed_optimizer_state(opt: Any, model_keys: Iterable[str], saved: dict[str, Any]) -> None:
    """Load stable-named state (:func:`keyed_optimizer_state`) into a keyed optimiser.

    Tensors already filled in place (the live ShardedTensors) are passed back as they are.

    Raises:
        ValueError: a state entry of the checkpoint has no counterpart in ``opt``.
    """
    sd = opt.state_dict()
    where = keyed_locations(sd, model_keys)
    new_state = {pkey: dict(entries) for pkey, entries in sd.get("state", {}).items()}
    for name, entries in saved["state"].items():
        for s, value in entries.items():
            if (name, s) not in where:
                raise ValueError(f"fused optimiser state {name}/{s} of the checkpoint has no counterpart in this run")
            pkey, orig = where[(name, s)]
            new_state[pkey][orig] = value
    groups = sd.get("param_groups", [])
    if len(saved.get("param_groups", [])) == len(groups):
        groups = [dict(s, params=g["params"]) for s, g in zip(saved["param_groups"], groups)]
    out = dict(sd, state=new_state)
    if "param_groups" in sd:
        out["param_groups"] = groups
    opt.load_state_dict(out)


# ---------------------------------------------------------------------------- row-wise state
def live_column_widths(weight: Any) -> list[int]:
    """Widths of a table's column shards, left to right (one width for a plain tensor)."""
    sharded = sharded_tensor_type()
    if sharded is not None and isinstance(weight, sharded):
        shards = weight.metadata().shards_metadata
        return [w for _, w in sorted({(int(s.shard_offsets[1]), int(s.shard_sizes[1])) for s in shards})]
    return [int(weight.shape[1])]


def convert_rowwise(saved: torch.Tensor, rows: int, saved_widths: list[int], live_widths: list[int]) -> torch.Tensor:
    """Row-wise optimiser state of one table, from one column sharding to another.

    TorchRec stores a row-wise accumulator per column shard, shard after shard (global size
    ``rows * len(widths)``). Each column is given its shard's value, then each new shard
    takes the width-weighted mean over its columns: exact when shards are merged (the
    accumulator is a mean over the row's columns), an approximation when one is split.

    Args:
        saved: the stored accumulator, ``(rows * len(saved_widths),)``.
        rows: the table's rows.
        saved_widths: the stored column shards' widths.
        live_widths: this run's column shards' widths.

    Returns:
        ``(rows * len(live_widths),)``.

    Raises:
        ValueError: the sizes do not fit that layout (e.g. grid or row-wise sharding).
    """
    if saved.numel() != rows * len(saved_widths) or sum(saved_widths) != sum(live_widths):
        raise ValueError(
            f"row-wise optimiser state of {saved.numel()} values does not fit {rows} rows in column shards "
            f"{saved_widths} (this run: {live_widths}); only table-wise and column-wise plans convert"
        )
    per_shard = saved.reshape(len(saved_widths), rows)
    per_column = torch.repeat_interleave(per_shard, torch.tensor(saved_widths), dim=0)  # (dim, rows)
    out, start = [], 0
    for w in live_widths:
        out.append(per_column[start : start + w].mean(dim=0))
        start += w
    return torch.cat(out)
