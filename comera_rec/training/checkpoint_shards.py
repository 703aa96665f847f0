"""Local shards of ShardedTensors in the per-process checkpoint format (before DCP).

Under DistributedModelParallel, sharded tables (and their fused optimiser state) appear in
state dicts as ShardedTensor objects, which a weights-only load refuses. Each process
writes its own file, so it is enough to store the process's local shards as plain
tensors and to copy them back into the live ShardedTensors after the model is sharded
again the same way.
"""

from __future__ import annotations

from typing import Any

import torch

LOCAL_SHARDS = "__local_shards__"


def sharded_tensor_type() -> type | None:
    """The ``ShardedTensor`` class, or None when torch lacks distributed support."""
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return ShardedTensor


def localize(obj: Any) -> Any:
    """``obj`` with every ShardedTensor replaced by ``{LOCAL_SHARDS: [local shard tensors]}``.

    Example::

        >>> localize({"w": torch.ones(2)})["w"]
        tensor([1., 1.])
    """
    sharded = sharded_tensor_type()
    if sharded is not None and isinstance(obj, sharded):
        return {LOCAL_SHARDS: [shard.tensor.detach().clone() for shard in obj.local_shards()]}
    if isinstance(obj, dict):
        return {k: localize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(localize(v) for v in obj)
    return obj


@torch.no_grad()
def restore_local(live: Any, saved: Any, where: str = "state") -> Any:
    """Copy saved local shards into the ShardedTensors of ``live``; return ``saved`` with
    those entries replaced by the (now filled) live ShardedTensors, ready for a
    ``load_state_dict``.

    Raises:
        ValueError: when the saved shards do not match the live ones (another sharding).
    """
    sharded = sharded_tensor_type()
    if isinstance(saved, dict) and LOCAL_SHARDS in saved:
        if sharded is None or not isinstance(live, sharded):
            raise ValueError(
                f"{where}: the checkpoint holds shards of a sharded tensor, the model a plain one; "
                "resume with the same sharding (embedding_optim.sharding_type) and world size"
            )
        shards = live.local_shards()
        stored = saved[LOCAL_SHARDS]
        if len(shards) != len(stored) or any(a.tensor.shape != b.shape for a, b in zip(shards, stored)):
            raise ValueError(
                f"{where}: the checkpoint's local shards {[tuple(t.shape) for t in stored]} do not "
                f"match this process's {[tuple(s.tensor.shape) for s in shards]}; resume with the same "
                "sharding and world size"
            )
        for shard, tensor in zip(shards, stored):
            shard.tensor.copy_(tensor)
        return live
    if isinstance(saved, dict) and isinstance(live, dict):
        return {k: restore_local(live.get(k), v, f"{where}.{k}") for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        return type(saved)(restore_local(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(live, saved)))
    return saved
