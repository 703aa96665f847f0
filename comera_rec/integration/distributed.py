"""DistributedModelParallel glue for compressed models.

Layout under ``DistributedModelParallel`` (DMP):

* dense embedding tables (TorchRec ``EmbeddingBagCollection`` modules, including the
  ``dense`` part of every :class:`TTMEmbeddingBagCollection`) are sharded by TorchRec's
  planner and run as FBGEMM table-batched kernels whose optimizer is fused into the
  backward (the class given by :class:`EmbeddingOptimizerSpec`);
* everything else (TT cores and controllers, MLPs, cross nets) is replicated and wrapped
  in one ``DistributedDataParallel``, which all-reduces (averages) its gradients; those
  parameters are stepped by the *dense* optimizer after backward.

After ``truncate_ranks`` replaces TT parameters by smaller ones the DDP wrapper still
holds the old ones and silently stops syncing the new ones: call
:func:`rewrap_data_parallel` after any truncation, and point the optimiser of the
replicated parameters at the new ones (``comera_rec.rank.retarget_optimizer``, or
``comera_rec.training.rebuild_optimizer``; :class:`~comera_rec.RankAdapter` does both).
The optimiser of the replicated parameters is the caller's: build it over
:func:`replicated_parameter_groups` (``comera_rec.training.build_optimizer`` builds the
method's AdamW with one group per kind).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from comera_rec.integration.kernel_support import check_dense_table_kernels, dense_collections, dense_table_names
from comera_rec.integration.torchrec_internals import (
    collection_device,
    rewrap_dmp_data_parallel,
    set_collection_device,
    sharded_tensor_type,
)
from comera_rec.tensor.train import InitOnMaterialize, parameter_groups

ParamGroups = dict[str, list[nn.Parameter]]


@dataclass(frozen=True)
class EmbeddingOptimizerSpec:
    """Optimizer of the dense embedding tables, fused into the backward pass."""

    optimizer_class: type[torch.optim.Optimizer] = RowWiseAdagrad
    """SGD, Adagrad, RowWiseAdagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD) or Adam."""
    kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 0.01, "eps": 1e-8})
    """Constructor arguments (``lr``, ``eps``, ...)."""


CPU_SHARDING_TYPES: tuple[str, ...] = ("table_wise", "column_wise", "table_column_wise")
"""Sharding types of dense tables that train under DMP on CPU. ``data_parallel`` is not one:
it runs FBGEMM's dense lookup, which fbgemm-gpu-cpu 1.8.0 registers with no autograd kernel,
so a replicated table gets no gradient and never changes (silently: torch only warns that
the op has no autograd kernel). ``row_wise`` is not offered on CPU."""


def dense_table_constraints(
    model: nn.Module,
    device: torch.device,
    sharding_type: str | None = None,
    constraints: dict[str, ParameterConstraints] | None = None,
) -> dict[str, ParameterConstraints]:
    """The planner's constraints for the dense tables of ``model``.

    ``sharding_type`` (when given) applies to every table, then ``constraints`` override per
    table. On CPU every table is limited to :data:`CPU_SHARDING_TYPES`, and asking for
    ``data_parallel`` is an error.

    Args:
        model: the model whose TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection``
            tables are planned.
        device: the compute device of the processes.
        sharding_type: one sharding type for every table, or ``None`` for the planner's choice.
        constraints: per-table constraints, by table name.

    Returns:
        Constraints by table name (empty when nothing restricts the planner).

    Example::

        >>> dense_table_constraints(model, torch.device("cpu"))["t_cat_0"].sharding_types  # doctest: +SKIP
        ['table_wise', 'column_wise', 'table_column_wise']
    """
    names = dense_table_names(model)
    out: dict[str, ParameterConstraints] = {}
    if sharding_type is not None:
        out = {name: ParameterConstraints(sharding_types=[sharding_type]) for name in names}
    out.update(constraints or {})
    if device.type != "cpu":
        return out
    for name in names:
        given = out.get(name)
        if given is None or given.sharding_types is None:
            out[name] = replace(given or ParameterConstraints(), sharding_types=list(CPU_SHARDING_TYPES))
        elif "data_parallel" in given.sharding_types:
            raise ValueError(
                f"table {name!r}: sharding type 'data_parallel' does not train on CPU (FBGEMM's CPU dense "
                f"lookup has no autograd kernel, so the table would never change); use one of "
                f"{', '.join(CPU_SHARDING_TYPES)}"
            )
    return out


def materialize_tensor_trains(model: nn.Module, device: torch.device | str) -> None:
    """Allocate and initialise TT modules (and TT cross nets) built on the meta device.

    Their parameters live in ``ParameterList`` children, which have no
    ``reset_parameters``: each such module is moved with ``to_empty`` and initialised by
    its own ``reset_parameters``. Stock ``DistributedModelParallel`` reaches the same
    ``reset_parameters`` through ``model.apply`` (see
    :class:`~comera_rec.tensor.train.InitOnMaterialize`); this function is for the other
    paths (``wrap_model`` without a process group).
    """
    for _, module in model.named_modules():
        if isinstance(module, InitOnMaterialize) and any(p.is_meta for p in module.parameters()):
            module.to_empty(device=device)
            module.reset_parameters()


def _fused_table_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, module in dense_collections(model) for p in module.parameters()]


def replicated_parameter_groups(model: nn.Module) -> ParamGroups:
    """TT cores, controllers and other trainable parameters, without embedding tables
    (sharded tables, or tables updated by an optimizer in backward)."""
    unwrapped = get_unwrapped_module(model)
    sharded = set(DistributedModelParallel._sharded_parameter_names(unwrapped))
    skip = {id(p) for n, p in unwrapped.named_parameters() if n in sharded}
    skip |= {id(p) for p in unwrapped.parameters() if hasattr(p, "_in_backward_optimizers")}
    for _, module in unwrapped.named_modules():
        if isinstance(module, FusedEmbeddingBagCollection):  # updated inside backward
            skip |= {id(p) for p in module.parameters()}
    groups = parameter_groups(unwrapped)
    return {k: [p for p in v if id(p) not in skip] for k, v in groups.items()}


_RESERVED_MEMORY_SHARE = 0.15
"""Share of each rank's memory the planner keeps out of its table placement (for
activations, the replicated parameters and their optimiser state)."""


def host_memory_bytes() -> int:
    """This host's memory, or the cgroup's limit when that is lower (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def planner_topology(world_size: int, device: torch.device) -> Topology:
    """TorchRec's planner topology for ``world_size`` ranks with this host's real memory.

    Built by ``TopologyFactory`` as TorchRec asks. Its default capacities (128 GiB of host
    memory per rank, 32 GiB of HBM per GPU) are not this machine's: each rank gets the host's
    memory divided among the ranks of this host (``LOCAL_WORLD_SIZE``), and a GPU rank its
    device's memory, so that a plan that cannot fit fails in the planner, not in training.

    Args:
        world_size: ranks in the job.
        device: this rank's compute device.

    Example::

        >>> planner_topology(2, torch.device("cpu")).devices[0].storage.ddr > 0
        True
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    trainer = TrainerConfig(world_size=world_size, local_world_size=local, ddr_cap_bytes=host_memory_bytes() // local)
    if device.type == "cuda":
        trainer = replace(trainer, hbm_cap_bytes=torch.cuda.get_device_properties(device).total_memory)
    return TopologyFactory.create_topology(trainer, kernel_config=KernelConfig(compute_device=device.type))


def wrap_model(
    model: nn.Module,
    *,
    device: torch.device | str,
    world_size: int | None = None,
    embedding_optimizer: EmbeddingOptimizerSpec | None = None,
    sharding_type: str | None = None,
    constraints: dict[str, ParameterConstraints] | None = None,
) -> tuple[nn.Module, KeyedOptimizer | None]:
    """Wrap a (compressed) TorchRec model for training on one or many processes.

    With an initialised process group the model goes into ``DistributedModelParallel``:
    dense tables are sharded by TorchRec's planner, the rest is replicated under DDP.
    Without one (a single process), the model is moved to ``device`` and its dense
    tables get the same optimizer applied in backward, so the training loop is the same.
    Bag and sequence collections (``EmbeddingBagCollection``, ``EmbeddingCollection``, and
    the ``dense`` children of compressed ones) alike.

    Args:
        model: the model, possibly on the meta device.
        device: the compute device of this process (``cpu`` with gloo, ``cuda:LOCAL_RANK`` with nccl).
        world_size: checked against the process group's size when given.
        embedding_optimizer: optimizer of the dense tables, fused into backward.
        sharding_type: force one sharding type for every dense table (``"table_wise"``,
            ``"column_wise"``, ``"table_column_wise"``, ``"row_wise"`` or ``"data_parallel"``
            on GPUs; on CPU not ``"data_parallel"``, see :data:`CPU_SHARDING_TYPES`); the
            planner chooses when ``None``.
        constraints: per-table planner constraints (override ``sharding_type``).

    Returns:
        ``(wrapped model, fused optimiser)``: the fused optimiser holds the dense tables'
        optimiser state (a ``KeyedOptimizer``, for checkpoints; ``None`` when no table is
        fused). The replicated parameters (:func:`replicated_parameter_groups`) need an
        optimiser of the caller's.

    Example::

        >>> wrapped, fused = wrap_model(model, device=torch.device("cpu"))  # doctest: +SKIP
        >>> groups = replicated_parameter_groups(wrapped)  # doctest: +SKIP
        >>> optim = torch.optim.AdamW([p for ps in groups.values() for p in ps], lr=1e-4)  # doctest: +SKIP
        >>> loss, _ = wrapped(batch); loss.backward(); optim.step(); optim.zero_grad()  # doctest: +SKIP
    """
    device = torch.device(device)
    check_dense_table_kernels(model, device)  # before anything moves to the device
    spec = embedding_optimizer or EmbeddingOptimizerSpec()
    distributed = dist.is_available() and dist.is_initialized()
    if world_size is not None:
        actual = dist.get_world_size() if distributed else 1
        if world_size != actual:
            raise ValueError(f"wrap_model: world_size={world_size} but the process group has {actual} processes")
    materialize_tensor_trains(model, device)
    fused: KeyedOptimizer | None = None
    if not distributed:
        if any(p.is_meta for p in model.parameters()):
            _materialize_rest(model, device)
        model = model.to(device)
        # One process: FBGEMM's table-batched kernels with the optimizer fused into
        # backward, the same kernels DMP uses when it shards the tables; sequence tables
        # (EmbeddingCollection: TorchRec has no fused CPU module for them) get the same
        # optimizer applied in backward to their own weights.
        fused_bags = _fuse_dense_tables(model, spec, device)
        return model, _combined([fused_bags, _sequence_tables_in_backward(model, spec)])

    tables = [p for p in _fused_table_params(model) if not hasattr(p, "_in_backward_optimizers")]
    if tables:
        _apply_optimizer_in_backward(spec.optimizer_class, tables, dict(spec.kwargs))
    if distributed:
        sharders = get_default_sharders()
        table_constraints = dense_table_constraints(model, device, sharding_type, constraints)
        planner = EmbeddingShardingPlanner(
            topology=planner_topology(dist.get_world_size(), device),
            constraints=table_constraints or None,
            storage_reservation=FixedPercentageStorageReservation(_RESERVED_MEMORY_SHARE),
        )
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
        tables_before = _table_weights(model)
        wrapped: nn.Module = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
        _load_sharded_tables(wrapped, tables_before)
        fused = wrapped.fused_optimizer
    return wrapped, fused


@torch.no_grad()
def _fuse_dense_tables(model: nn.Module, spec: EmbeddingOptimizerSpec, device: torch.device) -> KeyedOptimizer | None:
    """Replace every plain ``EmbeddingBagCollection`` by a ``FusedEmbeddingBagCollection``
    (same configs, weights and state-dict keys) and return their fused optimizers."""
    fused: list[tuple[str, KeyedOptimizer]] = []
    for name, module in list(model.named_modules()):
        if type(module) is not EmbeddingBagCollection:
            continue
        replacement = FusedEmbeddingBagCollection(
            module.embedding_bag_configs(),
            optimizer_type=spec.optimizer_class,
            optimizer_kwargs=dict(spec.kwargs),
            is_weighted=module.is_weighted(),
            device=device,
        )
        replacement.load_state_dict(module.state_dict())
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        fused.append((name, replacement.fused_optimizer()))
    if not fused:
        return None
    return fused[0][1] if len(fused) == 1 else CombinedOptimizer(fused)


@torch.no_grad()
def _materialize_rest(model: nn.Module, device: torch.device) -> None:
    for _, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None and p.is_meta]
        if own:
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    for _, module in model.named_modules():
        configs = hasattr(module, "embedding_bag_configs") or hasattr(module, "embedding_configs")
        if configs and collection_device(module) is not None:
            if collection_device(module).type == "meta":
                set_collection_device(module, device)
                if type(module) in (EmbeddingBagCollection, EmbeddingCollection):
                    module.reset_parameters()


def _sequence_tables_in_backward(model: nn.Module, spec: EmbeddingOptimizerSpec) -> KeyedOptimizer | None:
    """Apply ``spec``'s optimizer in backward to the weights of every plain
    ``EmbeddingCollection``, as DMP does before sharding them; a ``KeyedOptimizer`` over
    those optimizers' state (for checkpoints), or ``None`` without such tables."""
    weights = {
        f"{prefix}.{name}" if prefix else name: p
        for prefix, module in dense_collections(model)
        if isinstance(module, EmbeddingCollection)
        for name, p in module.named_parameters()
        if not hasattr(p, "_in_backward_optimizers")
    }
    if not weights:
        return None
    _apply_optimizer_in_backward(spec.optimizer_class, list(weights.values()), dict(spec.kwargs))
    keyed = [
        KeyedOptimizer({name: p}, p._in_backward_optimizers[0].state, p._in_backward_optimizers[0].param_groups)
        for name, p in weights.items()
    ]
    return _combined(keyed)


def _combined(optimizers: list[KeyedOptimizer | None]) -> KeyedOptimizer | None:
    present = [o for o in optimizers if o is not None]
    if len(present) <= 1:
        return present[0] if present else None
    return CombinedOptimizer(present)


def _strip(name: str) -> str:
    for prefix in ("_dmp_wrapped_module.", "module."):
        name = name.removeprefix(prefix)
    return name


def _table_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Materialised weights of the tables DMP will shard (it re-initialises them)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in dense_collections(model):
        for name, p in module.named_parameters():
            if not p.is_meta:
                out[f"{prefix}.{name}" if prefix else name] = p.detach().clone()
    return out


@torch.no_grad()
def _load_sharded_tables(wrapped: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    ShardedTensor = sharded_tensor_type()
    for name, value in wrapped.state_dict().items():
        full = weights.get(_strip(name))
        if full is None:
            continue
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.tensor.shape
                shard.tensor.copy_(full[r0 : r0 + rows, c0 : c0 + cols])
        else:
            value.copy_(full)


def rewrap_data_parallel(wrapped: nn.Module) -> nn.Module:
    """Rebuild the DDP wrapper of ``wrapped`` after parameters changed shape (a rank cut).

    DDP registers its gradient hooks and buckets on the parameters it was built with: the
    new, smaller parameters would silently stop being averaged over processes. Under
    ``DistributedModelParallel`` the DDP inside is replaced through DMP's own data-parallel
    wrapper (the sharded tables and their fused optimiser are untouched); a bare
    ``DistributedDataParallel`` is rebuilt with the settings it had; anything else is
    returned as it is.

    Args:
        wrapped: the model as the training loop calls it.

    Returns:
        The model to call from now on (the same DMP object; a new DDP object).
    """
    if isinstance(wrapped, DistributedModelParallel):
        rewrap_dmp_data_parallel(wrapped)
        return wrapped
    if isinstance(wrapped, DistributedDataParallel):
        return DistributedDataParallel(
            wrapped.module,
            device_ids=wrapped.device_ids,
            output_device=wrapped.output_device,
            process_group=wrapped.process_group,
            broadcast_buffers=wrapped.forward_sync_buffers,
            bucket_cap_mb=wrapped.bucket_bytes_cap / (1024 * 1024),
            find_unused_parameters=wrapped.find_unused_parameters,
            gradient_as_bucket_view=wrapped.gradient_as_bucket_view,
            static_graph=wrapped.static_graph,
        )
    return wrapped


def destroy_distributed() -> None:
    """Collect garbage and destroy the default process group.

    Delete the wrapped model and the optimizers first (``del wrapped, optim, fused``): gloo
    aborts at exit in a fraction of runs when they outlive the process group.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
