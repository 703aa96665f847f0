"""Model-wide size accounting over every tensor-train module of a model.

The method's size ``S`` (method.md section 1) sums :meth:`TensorTrainModule.tt_size`
over the layers; the compression ratio compares the whole model with the dense model it
replaces (parameters outside tensor trains count as they are).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from comera_rec.tensor.train import tensor_train_modules


def model_tt_size(model: nn.Module, threshold: float = 0.0) -> int:
    """The size ``S``: core entries at the live ranks, summed over all TT modules.

    Args:
        model: any module; its :class:`TensorTrainModule` children are counted.
        threshold: controller entries below it are dead.

    Example::

        >>> model_tt_size(nn.Sequential(TTLinear(16, 8, rank=4)))
        128
    """
    return sum(m.tt_size(threshold) for _, m in tensor_train_modules(model))


def model_tt_bytes(model: nn.Module, threshold: float = 0.0) -> int:
    """``S`` in bytes: each module's size times the element size of its cores.

    Example::

        >>> model_tt_bytes(nn.Sequential(TTLinear(16, 8, rank=4)))  # float32
        512
    """
    return sum(m.tt_size(threshold) * m.cores[0].element_size() for _, m in tensor_train_modules(model))


def size_element_bytes(model: nn.Module) -> int:
    """Bytes per core entry of the first TT module (4 when there is none)."""
    for _, m in tensor_train_modules(model):
        return m.cores[0].element_size()
    return 4


def model_live_ranks(model: nn.Module, threshold: float = 0.0) -> dict[str, list[int]]:
    """Live ranks of every TT module by qualified name.

    Example::

        >>> model_live_ranks(nn.Sequential(TTLinear(16, 8, rank=4)))
        {'0': [4, 4, 4]}
    """
    return {name: m.live_ranks(threshold) for name, m in tensor_train_modules(model)}


def model_ranks(model: nn.Module) -> dict[str, list[int]]:
    """Physical (stored) ranks of every TT module by qualified name."""
    return {name: m.ranks for name, m in tensor_train_modules(model)}


def _sharded_sizes(model: nn.Module) -> dict[str, int]:
    """Whole-tensor element counts of the state-dict entries held in shards (``ShardedTensor``,
    ``DTensor``) by name: a sharded parameter is only this process's shard, which would make
    the count depend on the number of processes."""
    sizes: dict[str, int] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if hasattr(value, "local_shards"):  # ShardedTensor (its size() is deprecated; the metadata is not)
            sizes[name] = math.prod(value.metadata().size)
        elif hasattr(value, "to_local"):  # DTensor: its shape is the whole tensor's
            sizes[name] = math.prod(value.shape)
    return sizes


def _non_tt_parameters(model: nn.Module) -> int:
    in_tt: set[int] = set()
    for _, m in tensor_train_modules(model):
        in_tt.update(id(p) for p in m.parameters())
    sharded = _sharded_sizes(model)
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if id(p) in in_tt or id(p) in seen:
            continue
        seen.add(id(p))
        total += sharded.get(name, p.numel())
    return total


def model_num_bytes(model: nn.Module, threshold: float = 0.0) -> int:
    """Bytes of every parameter of the model: TT modules at their live ranks, the rest
    (dense tables, whole even when sharded; MLP biases; ...) as stored. A dense model's
    size is its parameters' bytes; :func:`model_tt_bytes` counts the TT cores only.

    Example::

        >>> model_num_bytes(nn.Linear(4, 2))
        40
    """
    total = 0
    in_tt: set[int] = set()
    for _, m in tensor_train_modules(model):
        own = list(m.parameters())
        in_tt.update(id(p) for p in own)
        total += m.num_parameters(threshold) * (own[0].element_size() if own else 4)
    sharded = _sharded_sizes(model)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in in_tt or id(p) in seen:
            continue
        seen.add(id(p))
        total += sharded.get(name, p.numel()) * p.element_size()
    return total


def _parameter_counts(model: nn.Module, threshold: float) -> tuple[int, int]:
    """(live, dense-equivalent) parameters of the whole model; the parameters outside the
    tensor trains, which both count, are walked once."""
    tt = [m for _, m in tensor_train_modules(model)]
    rest = _non_tt_parameters(model)
    live = sum(m.num_parameters(threshold) for m in tt) + rest
    return live, sum(m.dense_num_parameters() for m in tt) + rest


def model_num_parameters(model: nn.Module, threshold: float = 0.0) -> int:
    """Live parameters of the whole model: TT modules at their live ranks plus the rest."""
    return _parameter_counts(model, threshold)[0]


def model_dense_num_parameters(model: nn.Module) -> int:
    """Parameters of the same model with every TT module replaced by its dense original."""
    return _parameter_counts(model, 0.0)[1]


def model_compression_ratio(model: nn.Module, threshold: float = 0.0) -> float:
    """Dense parameters / live parameters over the whole model.

    Example::

        >>> model = nn.Sequential(TTLinear(64, 64, rank=2), nn.Linear(64, 1))
        >>> round(model_compression_ratio(model), 2)  # doctest: +SKIP
    """
    live, dense = _parameter_counts(model, threshold)
    return dense / max(1, live)


@torch.no_grad()
def total_live_rank(model: nn.Module, threshold: float = 0.0) -> int:
    """Sum of all live ranks of all TT modules (one number to plot)."""
    return sum(sum(r) for r in model_live_ranks(model, threshold).values())
