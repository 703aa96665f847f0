"""What one data-parallel DLRM step sends (:mod:`comera_rec.dlrm.scaling`): the sizes of a
model that set it (:func:`count_model`), the bytes per process and step
(:func:`step_bytes`) and the modelled seconds on a stated network (:func:`comm_time`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from comera_rec.integration.collection import TTMEmbeddingBagCollection

FLOAT_BYTES = 4  # fp32 gradients and pooled embeddings
ID_BYTES = 8  # int64 ids
LENGTH_BYTES = 4  # int32 lengths (what TorchRec's input all-to-all sends on gloo; see measure())


@dataclass(frozen=True)
class ModelComm:
    """The communication-relevant sizes of one DLRM."""

    name: str
    replicated_params: int
    """Trainable parameters outside the sharded tables (all-reduced by DDP every step)."""
    tt_table_params: int
    """Of those, the TT tables' cores and controllers."""
    sharded_features: int
    """Features looked up in sharded dense tables (their pooled outputs go through the all-to-all)."""
    sharded_table_params: int
    """Parameters of those tables (sharded: never all-reduced)."""
    embedding_dim: int

    @property
    def mlp_params(self) -> int:
        """Replicated parameters that are not TT tables (MLPs, cross net, interaction)."""
        return self.replicated_params - self.tt_table_params


def count_model(model: nn.Module, name: str = "") -> ModelComm:
    """Sizes of ``model`` (on any device, meta included) that set its per-step communication.

    Example::

        >>> from comera_rec.dlrm.config import DLRMConfig
        >>> from comera_rec.dlrm.model import build_dlrm
        >>> cfg = DLRMConfig(table_sizes=[1000, 50], embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], compressed=False)
        >>> c = count_model(build_dlrm(cfg, device="meta"))
        >>> c.sharded_features, c.sharded_table_params, c.tt_table_params
        (2, 8400, 0)
    """
    sharded: set[int] = set()
    features = 0
    dims: set[int] = set()
    tt: set[int] = set()
    for _, module in model.named_modules():
        if type(module) is EmbeddingBagCollection:
            sharded |= {id(p) for p in module.parameters()}
            for config in module.embedding_bag_configs():
                features += len(config.feature_names)
                dims.add(config.embedding_dim)
        elif isinstance(module, TTMEmbeddingBagCollection):
            tt |= {id(p) for p in module.parameters()}
            dims |= {c.embedding_dim for c in module.embedding_bag_configs()}
    tt -= sharded
    if len(dims) > 1:
        raise ValueError(f"count_model: tables of several dims {sorted(dims)}; DLRM has one")
    params = [p for p in model.parameters() if p.requires_grad]
    return ModelComm(
        name=name,
        replicated_params=sum(p.numel() for p in params if id(p) not in sharded),
        tt_table_params=sum(p.numel() for p in params if id(p) in tt),
        sharded_features=features,
        sharded_table_params=sum(p.numel() for p in model.parameters() if id(p) in sharded),
        embedding_dim=dims.pop() if dims else 0,
    )


@dataclass(frozen=True)
class StepBytes:
    """Bytes one process sends per training step (its share leaving the process)."""

    allreduce: float
    alltoall_pooled: float
    """Forward and backward together."""
    alltoall_ids: float

    @property
    def total(self) -> float:
        return self.allreduce + self.alltoall_pooled + self.alltoall_ids


def allreduce_payload(comm: ModelComm) -> int:
    """Bytes of gradient DDP all-reduces per step (each process's buffer)."""
    return comm.replicated_params * FLOAT_BYTES


def pooled_payload(comm: ModelComm, batch_per_rank: int) -> int:
    """Bytes of one direction of the pooled-embedding all-to-all, each process's buffer
    (the output it receives equals, on average, the input it sends)."""
    return batch_per_rank * comm.sharded_features * comm.embedding_dim * FLOAT_BYTES


def step_bytes(comm: ModelComm, world: int, batch_per_rank: int, ids_per_sample: float = 1.0) -> StepBytes:
    """Bytes one process sends per step with ``world`` processes (ring all-reduce; all-to-all
    with an even share per peer, averaged over processes).

    Example (one replicated parameter of 1000 floats, 2 features of dim 4, batch 10, 2 processes)::

        >>> c = ModelComm("x", 1000, 0, 2, 0, 4)
        >>> s = step_bytes(c, 2, 10)
        >>> s.allreduce, s.alltoall_pooled, s.alltoall_ids
        (4000.0, 320.0, 120.0)
    """
    if world < 1:
        raise ValueError(f"step_bytes: world={world}")
    leaving = (world - 1) / world
    ids = batch_per_rank * comm.sharded_features * (ids_per_sample * ID_BYTES + LENGTH_BYTES)
    return StepBytes(
        allreduce=2 * leaving * allreduce_payload(comm),
        alltoall_pooled=2 * leaving * pooled_payload(comm, batch_per_rank),
        alltoall_ids=leaving * ids,
    )


@dataclass(frozen=True)
class Network:
    """A stated cluster (the projection's assumptions; docs/scaling.md)."""

    gpus_per_node: int = 8
    intra_GBps: float = 300.0
    """Usable NVLink bandwidth per GPU and direction (H100 NVLink 4: 450 GB/s nominal)."""
    inter_GBps: float = 50.0
    """Per GPU: one 400 Gb/s NIC each (8 x 400 Gb/s per node)."""
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    per_peer_us: float = 0.5
    """All-to-all overhead per peer (N-1 messages per process)."""


def allreduce_time(payload: float, world: int, net: Network) -> float:
    """Seconds for a hierarchical all-reduce of ``payload`` bytes per process: reduce-scatter
    and all-gather inside the node over NVLink, a ring across nodes over each GPU's own NIC
    on its 1/g shard, and a tree-like latency term (a model).

    Example::

        >>> allreduce_time(1e9, 1, Network())
        0.0
    """
    if world <= 1:
        return 0.0
    g = min(world, net.gpus_per_node)
    nodes = math.ceil(world / net.gpus_per_node)
    intra = (
        2 * (g - 1) / g * payload / (net.intra_GBps * 1e9) + 2 * math.ceil(math.log2(g)) * net.intra_latency_us * 1e-6
    )
    if nodes == 1:
        return intra
    inter = 2 * (nodes - 1) / nodes * (payload / g) / (net.inter_GBps * 1e9)
    return intra + inter + 2 * math.ceil(math.log2(nodes)) * net.inter_latency_us * 1e-6


def alltoall_time(payload: float, world: int, net: Network) -> float:
    """Seconds for an all-to-all where each process holds ``payload`` bytes split evenly over
    the ``world`` processes: the node's peers over NVLink and the other nodes over the NIC at
    once, plus latency and a per-peer overhead (a model)."""
    if world <= 1:
        return 0.0
    g = min(world, net.gpus_per_node)
    intra = payload * (g - 1) / world / (net.intra_GBps * 1e9)
    inter = payload * (world - g) / world / (net.inter_GBps * 1e9)
    latency = net.inter_latency_us if world > g else net.intra_latency_us
    return max(intra, inter) + (latency + (world - 1) * net.per_peer_us) * 1e-6


@dataclass(frozen=True)
class StepTime:
    allreduce: float
    alltoall: float
    """Pooled forward + backward and ids, seconds."""

    @property
    def total(self) -> float:
        return self.allreduce + self.alltoall


def comm_time(
    comm: ModelComm, world: int, batch_per_rank: int, net: Network = Network(), ids_per_sample: float = 1.0
) -> StepTime:
    """Modelled communication seconds per step (no overlap with compute counted)."""
    pooled = pooled_payload(comm, batch_per_rank)
    ids = batch_per_rank * comm.sharded_features * (ids_per_sample * ID_BYTES + LENGTH_BYTES)
    a2a = 2 * alltoall_time(pooled, world, net) + alltoall_time(ids, world, net)
    return StepTime(allreduce=allreduce_time(allreduce_payload(comm), world, net), alltoall=a2a)
