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
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

PLACEHOLDER = "__dcp__"
"""Key of the dict that stands for a tensor in a skeleton: ``{PLACEHOLDER: flat key}``."""

SHARED_DIR = "shared"
"""Sub-folder of a checkpoint holding the DCP files."""

# What a DCP .metadata file may name: DCP's own records, torch.Size, dtypes, a path
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name in ("Size", "device") or isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names {module}.{name}, which is not a DCP record type; refused (never run)"
        )


class SafeReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose metadata is read with an allow-list unpickler.

    Args:
        path: the DCP folder.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        super().__init__(str(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata; refuses a file naming any other type."""
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path}/.metadata holds a {type(metadata).__name__}, not DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------------- skeletons
def _sharded_type() -> Optional[type]:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return ShardedTensor


def is_tensor_like(value: Any) -> bool:
    """True for a tensor or a ShardedTensor (what goes into DCP)."""
    sharded = _sharded_type()
    return isinstance(value, torch.Tensor) or (sharded is not None and isinstance(value, sharded))


def split_tensors(obj: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """Take ``obj`` apart into a skeleton and a flat dict of its tensors.

    Args:
        obj: a nested state of dicts (string or int keys), lists, tuples, tensors,
            ShardedTensors and plain values.
        prefix: the flat keys' first part (``model``); parts are joined with ``/`` so that
            the dots of parameter names stay readable.

    Returns:
        ``(skeleton, flat)``: the skeleton has ``{PLACEHOLDER: key}`` where a tensor was;
        ``flat[key]`` is that tensor.

    Example::

        >>> split_tensors({"w": torch.ones(2), "n": 3}, "m")
        ({'w': {'__dcp__': 'm/w'}, 'n': 3}, {'m/w': tensor([1., 1.])})
    """
    flat: dict[str, Any] = {}

    def walk(x: Any, path: str) -> Any:
        if is_tensor_like(x):
            flat[path] = x
            return {PLACEHOLDER: path}
        if isinstance(x, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v, f"{path}/{i}") for i, v in enumerate(x))
        return x

    return walk(obj, prefix), flat


def fill_skeleton(skeleton: Any, flat: dict[str, Any]) -> Any:
    """Put the tensors of ``flat`` back where :func:`split_tensors` took them from.

    Raises:
        KeyError: a placeholder names a key ``flat`` lacks.
    """
    if isinstance(skeleton, dict):
        if set(skeleton) == {PLACEHOLDER}:
            return flat[skeleton[PLACEHOLDER]]
        return {k: fill_skeleton(v, flat) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(fill_skeleton(v, flat) for v in skeleton)
    return skeleton


def complete_skeleton(skeleton: Any, keys: Iterable[str]) -> Any:
    """``skeleton`` with a placeholder added for every stored key it does not name.

    TorchRec's fused optimiser lists on each process only the tables that process holds,
    so each rank file's skeleton names only its own part of that state; the DCP metadata
    names all of it. Missing entries are added as dict entries along their path (a list
    on the path is indexed by the part's number).

    Args:
        skeleton: a skeleton from a rank file (changed in place and returned).
        keys: every key stored in the DCP folder.

    Raises:
        ValueError: a key's path runs through a value that is not a dict or a list.
    """
    known = set(placeholders(skeleton))
    for key in keys:
        if key in known:
            continue
        parts = key.split("/")
        node = skeleton
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, dict):
                node = node.setdefault(part, {})
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"stored tensor {key!r} does not fit the checkpoint's structure at {parts[i]!r}")
        if not isinstance(node, dict):
            raise ValueError(f"stored tensor {key!r} does not fit the checkpoint's structure")
        node[parts[-1]] = {PLACEHOLDER: key}
    return skeleton


def placeholders(skeleton: Any) -> list[str]:
    """Every flat key named in ``skeleton``, in walk order."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {PLACEHOLDER}:
            return [skeleton[PLACEHOLDER]]
        return [k for v in skeleton.values() for k in placeholders(v)]
    if isinstance(skeleton, (list, tuple)):
        return [k for v in skeleton for k in placeholders(v)]
    return []


# ---------------------------------------------------------------------------- storage
def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: that is what is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_shared(folder: Path, flat: dict[str, Any], group: Any = None) -> list[Path]:
    """Write ``flat`` with DCP into ``folder`` (collective when a group is initialised).

    Args:
        folder: the DCP folder (created by rank 0 before the call).
        flat: flat key -> tensor (replicated: the same on every process) or ShardedTensor.
        group: the process group DCP plans over (None: the default group).

    Returns:
        The files this process wrote (``__R_*.distcp``, and ``.metadata`` on rank 0), for
        the checksums.
    """
    grouped = _grouped()
    with _one_process_quiet():
        writer = dcp.FileSystemWriter(str(folder), sync_files=True)
        dcp.save(flat, storage_writer=writer, process_group=group, no_dist=not grouped)
    rank = dist.get_rank() if grouped else 0
    mine = sorted(folder.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(folder / ".metadata")
    return mine


def read_metadata(folder: Union[str, Path]) -> Metadata:
    """The DCP metadata of ``folder`` (read with the allow-list unpickler)."""
    return SafeReader(folder).read_metadata()


def tensor_shapes(folder: Union[str, Path, Metadata]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global size and dtype of every tensor stored in the DCP folder (or its metadata)."""
    metadata = folder if isinstance(folder, Metadata) else read_metadata(folder)
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out[key] = (md.size, md.properties.dtype)
    return out


def column_widths(metadata: Metadata, key: str) -> Optional[list[int]]:
    """Widths of the column chunks a 2-d tensor was saved in, left to right (None: unknown).

    Args:
        metadata: the DCP folder's metadata (:func:`read_metadata`).
        key: the tensor's flat key.
    """
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata) or len(md.size) != 2:
        return None
    starts = sorted({(int(c.offsets[1]), int(c.sizes[1])) for c in md.chunks})
    return [w for _, w in starts]


def load_whole(folder: Union[str, Path], keys: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """Read stored tensors whole, as plain CPU tensors, in this process alone.

    Sharded tables come back gathered. No collective runs, so any process may call it,
    with or without a process group.

    Args:
        folder: the DCP folder.
        keys: the flat keys to read; all tensors by default.

    Returns:
        Flat key -> tensor.
    """
    shapes = tensor_shapes(folder)
    wanted = list(shapes) if keys is None else list(keys)
    missing = [k for k in wanted if k not in shapes]
    if missing:
        raise KeyError(f"{folder}: no tensor stored under {missing[:5]}")
    out = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in wanted}
    if out:
        with _one_process_quiet():
            dcp.load(out, storage_reader=SafeReader(folder), no_dist=True)
    return out


def load_into(folder: Union[str, Path], targets: dict[str, Any]) -> None:
    """Fill ``targets`` (tensors and ShardedTensors of the right global size) from the
    DCP folder (collective: every process calls it).

    A ShardedTensor receives the chunks of its local shards, whatever the sharding the
    checkpoint was written with; a plain tensor receives the whole tensor. The keys may
    differ between processes (TorchRec's fused state names only the tables a process holds).
    """
    with _one_process_quiet():
        dcp.load(targets, storage_reader=SafeReader(folder), no_dist=not _grouped())


# ---------------------------------------------------------------------------- optimisers
def _param_names(model: nn.Module) -> dict[int, str]:
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
    names = _param_names(model)
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


def _suffix_index(model_keys: Iterable[str]) -> dict[str, list[str]]:
    """Model keys by their last two name parts (``t_cat_2.weight``)."""
    index: dict[str, list[str]] = {}
    for k in model_keys:
        index.setdefault(".".join(k.split(".")[-2:]), []).append(k)
    return index


def _model_key(key: str, model_keys: set[str], suffixes: dict[str, list[str]]) -> str:
    """The model state-dict key a fused optimiser names ``key``: itself, or the one key
    that ends with it (one process's fused tables use the table's own name)."""
    if key in model_keys:
        return key
    found = [k for k in suffixes.get(".".join(key.split(".")[-2:]), []) if k.endswith("." + key)]
    return found[0] if len(found) == 1 else key


def _state_name(name: str) -> str:
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
    suffixes = _suffix_index(keys)
    state = {
        _model_key(str(pkey), keys, suffixes): {_state_name(s): v for s, v in entries.items()}
        for pkey, entries in sd.get("state", {}).items()
    }
    return {"state": state, "param_groups": sd.get("param_groups", [])}


def _keyed_locations(sd: dict[str, Any], model_keys: Iterable[str]) -> dict[tuple[str, str], tuple[Any, Any]]:
    """(stable table key, stable state name) -> (the optimiser's param key, its state name)."""
    keys = set(model_keys)
    suffixes = _suffix_index(keys)
    return {
        (_model_key(str(pkey), keys, suffixes), _state_name(s)): (pkey, s)
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
    where = _keyed_locations(sd, model_keys)
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
    sharded = _sharded_type()
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
    sharded = _sharded_type()
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
