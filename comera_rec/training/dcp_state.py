"""The shared part of a checkpoint on ``torch.distributed.checkpoint`` (DCP).

A checkpoint keeps each process's own small state (counters, RNG streams, the rank
schedule) in its rank file and the *global* tensors (the model, the optimisers' state) in
one DCP folder, ``step_N/shared/``. DCP stores a replicated tensor once and a sharded one
(TorchRec's ShardedTensor tables and their fused optimiser state) as chunks with their
global offsets, so a checkpoint written by N processes with one sharding plan loads into M
processes with another: every process reads the parts of the global tensors it holds.

What this module adds to DCP:

* **Weights-only reading.** DCP unpickles its ``.metadata`` file with plain ``pickle`` and
  loads non-tensor values with ``torch.load(weights_only=False)``. :class:`SafeReader`
  unpickles the metadata with an allow-list of DCP's own record classes, ``torch.Size``
  and dtypes, and only tensors are ever stored or requested, so no pickled code runs.
* **Skeletons.** :func:`split_tensors` takes a nested state (dicts, lists, tuples) apart
  into a flat dict of tensors keyed by path and a skeleton holding everything else, with a
  placeholder where each tensor was; :func:`fill_skeleton` puts them back together.
* **Stable names for optimiser state.** A torch optimiser keys its state by parameter
  index and TorchRec's fused optimiser by a name that differs between one process
  (``t_cat_2.weight``) and DMP (``model....t_cat_2.weight``);
  :func:`optimizer_state` / :func:`keyed_optimizer_state` key both by the model's
  state-dict names, so the state finds its parameter whatever the world size.
* **Row-wise state across table sharding plans.** TorchRec keeps one row-wise Adagrad
  accumulator per column shard (global size rows x column shards), so a table-wise
  checkpoint's accumulators do not fit a column-wise run: :func:`convert_rowwise` maps
  them through the columns (exact from several column shards to one; an approximation the
  other way, see docs/reliability.md).

The pieces live in :mod:`comera_rec.training.dcp_io` (weights-only reading and the
storage calls), :mod:`comera_rec.training.dcp_skeleton` (skeletons) and
:mod:`comera_rec.training.dcp_optim` (optimiser state, row-wise conversion); this module
assembles the trainer's shared state (:func:`shared_state`, :func:`restore_shared`) and
re-exports them all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from comera_rec.training.checkpoint_shards import sharded_tensor_type
from comera_rec.training.dcp_io import (  # noqa: F401
    ALLOWED_GLOBALS,
    MetadataUnpickler,
    SafeReader,
    column_widths,
    load_into,
    load_whole,
    one_process_quiet,
    process_group_initialized,
    read_metadata,
    save_shared,
    tensor_shapes,
)
from comera_rec.training.dcp_optim import (  # noqa: F401
    convert_rowwise,
    keyed_locations,
    keyed_optimizer_state,
    live_column_widths,
    load_keyed_optimizer_state,
    load_optimizer_state,
    model_key,
    optimizer_state,
    param_names,
    state_name,
    suffix_index,
)
from comera_rec.training.dcp_skeleton import (  # noqa: F401
    PLACEHOLDER,
    complete_skeleton,
    fill_skeleton,
    is_tensor_like,
    placeholders,
    split_tensors,
)

SHARED_DIR = "shared"
"""Sub-folder of a checkpoint holding the DCP files."""


# ---------------------------------------------------------------------------- the trainer's state
def _global_size(value: Any) -> tuple[int, ...]:
    return tuple(value.size())


def shared_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: list[Any]) -> dict[str, Any]:
    """The trainer's global state for a checkpoint's shared part.

    Args:
        model: the unwrapped model (its sharded tables appear as ShardedTensors).
        optimizer: the torch optimiser of the replicated parameters.
        extra: the task's other optimisers (TorchRec's fused optimiser of the tables).

    Returns:
        ``{"model": state dict, "optimizer": ..., "extra_optimizers": [...]}`` with the
        torch optimiser's state keyed by the model's parameter names; each extra optimiser
        is ``{"keyed": ...}`` (a TorchRec keyed optimiser, its state under stable names:
        :func:`keyed_optimizer_state`) or ``{"plain": its state_dict}`` (any other).
    """
    model_sd = model.state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer_state(optimizer, model) if optimizer is not None else {},
        "extra_optimizers": [_extra_state(o.state_dict(), model_sd) for o in extra],
    }


def _is_keyed(sd: Any) -> bool:
    """A TorchRec keyed optimiser's state dict: ``state`` (and the groups' ``params``, where
    there are any) keyed by parameter names, not by index."""
    state = sd.get("state") if isinstance(sd, dict) else None
    if not isinstance(state, dict):
        return False
    keys = list(state) + [p for g in sd.get("param_groups", []) for p in g.get("params", [])]
    return len(keys) > 0 and all(isinstance(k, str) for k in keys)


def _extra_state(sd: Any, model_keys: Iterable[str]) -> dict[str, Any]:
    if _is_keyed(sd):
        return {"keyed": keyed_optimizer_state(sd, model_keys)}
    return {"plain": sd}


def shared_model_shapes(path: Union[str, Path], skeleton: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The saved model's state dict as empty ``meta`` tensors of the saved global shapes.

    Enough for the compatibility check and for resizing truncated TT cores before the load
    (:func:`comera_rec.rank.truncation.resize_to_state_dict`); no tensor data is read.

    Args:
        path: the checkpoint folder.
        skeleton: the shared part's skeleton from its rank file.
    """
    shapes = tensor_shapes(Path(path) / SHARED_DIR)
    out = {}
    for key, entry in skeleton["model"].items():
        if isinstance(entry, dict) and set(entry) == {PLACEHOLDER}:
            size, dtype = shapes[entry[PLACEHOLDER]]
            out[key] = torch.empty(size, dtype=dtype, device="meta")
    return out


def _without(skeleton: Any, keys: set[str]) -> Any:
    """``skeleton`` less the placeholders of ``keys`` (and the dicts they leave empty)."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {PLACEHOLDER}:
            return skeleton
        out = {}
        for k, v in skeleton.items():
            if isinstance(v, dict) and set(v) == {PLACEHOLDER} and v[PLACEHOLDER] in keys:
                continue
            pruned = _without(v, keys)
            if isinstance(v, dict) and v and not pruned:
                continue
            out[k] = pruned
        return out
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_without(v, keys) for v in skeleton)
    return skeleton


@torch.no_grad()
def _copy_rowwise(live: Any, value: torch.Tensor) -> None:
    """Copy a whole 1-d tensor into ``live`` (a plain tensor, or this process's shards)."""
    sharded = sharded_tensor_type()
    if sharded is not None and isinstance(live, sharded):
        for shard in live.local_shards():
            start, n = int(shard.metadata.shard_offsets[0]), int(shard.metadata.shard_sizes[0])
            shard.tensor.copy_(value[start : start + n].reshape(shard.tensor.shape))
    else:
        live.copy_(value.reshape(live.shape))


def restore_shared(
    path: Union[str, Path],
    skeleton: dict[str, Any],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    extra: list[Any],
) -> None:
    """Load a checkpoint's shared part into a built, wrapped model and its optimisers
    (collective: every process of the run calls it).

    The model must already have the saved TT ranks (:func:`shared_model_shapes`). Sharded
    tables and their fused state are read into this process's shards, whatever sharding
    and world size wrote them; the row-wise accumulators of a table sharded into other
    column shards are converted (:func:`convert_rowwise`); the torch optimiser's state is
    matched to parameters by name.

    Raises:
        ValueError: a tensor of the checkpoint has no place in this run, or a shape that
            cannot be converted.
    """
    folder = Path(path) / SHARED_DIR
    metadata = read_metadata(folder)
    shapes = tensor_shapes(metadata)
    model_sd = model.state_dict()
    if len(skeleton.get("extra_optimizers", [])) != len(extra):
        raise ValueError(
            f"{path}: the checkpoint has {len(skeleton.get('extra_optimizers', []))} extra optimisers, "
            f"the task {len(extra)}"
        )
    live_extra = [_extra_state(o.state_dict(), model_sd) for o in extra]
    skeleton = complete_skeleton(skeleton, shapes)
    targets: dict[str, Any] = {}
    converts: list[tuple[str, Any, str]] = []  # (flat key, live tensor, table key)
    not_here: set[str] = set()  # fused state of tables this process holds no shard of
    for i, live in enumerate(live_extra):
        if set(live) != set(skeleton["extra_optimizers"][i]):
            raise ValueError(f"{path}: extra optimiser {i} is of another kind than the checkpoint's")
        for table, entries in live.get("keyed", {}).get("state", {}).items():
            for name in entries:
                if f"extra_optimizers/{i}/keyed/state/{table}/{name}" not in shapes:
                    raise ValueError(f"{path}: the checkpoint holds no fused optimiser state {table}/{name}")
    for key in placeholders(skeleton):
        size, dtype = shapes[key]
        parts = key.split("/")
        target = None
        if parts[0] == "model":
            target = model_sd.get("/".join(parts[1:]))
            if target is None:
                raise ValueError(f"{path}: the checkpoint's {key} is not in this model")
        elif parts[0] == "extra_optimizers" and parts[2] == "keyed" and len(parts) == 6 and parts[3] == "state":
            i, table, name = int(parts[1]), parts[4], parts[5]
            entries = live_extra[i]["keyed"]["state"].get(table, {})
            target = entries.get(name)
            if target is None:  # TorchRec lists only this process's tables: another one loads it
                not_here.add(key)
                continue
            if _global_size(target) != tuple(size):
                converts.append((key, target, table))
                target = None  # read whole, converted below
        if target is None:  # optimiser state (a fresh optimiser has none) or to convert
            target = torch.empty(size, dtype=dtype)
        elif _global_size(target) != tuple(size):
            raise ValueError(f"{path}: {key} has shape {list(size)} in the checkpoint, {list(target.size())} here")
        targets[key] = target
    load_into(folder, targets)
    for key, target, table in converts:
        weight = model_sd[table]
        value = convert_rowwise(
            targets[key],
            int(weight.size(0)),
            column_widths(metadata, f"model/{table}") or [int(weight.size(1))],
            live_column_widths(weight),
        )
        _copy_rowwise(target, value)
        targets[key] = target
    filled = fill_skeleton(_without(skeleton, not_here), targets)
    model.load_state_dict(filled["model"])
    if optimizer is not None and filled.get("optimizer"):
        load_optimizer_state(optimizer, model, filled["optimizer"])
    for opt, sd in zip(extra, filled["extra_optimizers"]):
        if "keyed" in sd:
            load_keyed_optimizer_state(opt, model_sd, sd["keyed"])
        else:
            opt.load_state_dict(sd["plain"])
