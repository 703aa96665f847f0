"""Tensor-train cores with rank controllers: the state shared by TT layers and TTM tables.

A train of K cores ``G_1 .. G_K`` has rank dimensions first and last on every core,
``G_k: (*batch, r_{k-1}, *modes_k, r_k)`` with ``r_0 = r_K = 1``. Between core k and
core k+1 sits a learnable rank controller ``D_k`` (a vector of length ``r_k``,
initialised to 1); the effective train is ``G_1 D_1 G_2 ... D_{K-1} G_K``. Entries of
``D_k`` whose magnitude falls below a threshold are dead: the matching slices of
``G_k`` and ``G_{k+1}`` are cut out by :meth:`TensorTrainModule.truncate_ranks`, so
memory and compute really fall.

``batch`` is empty for one train and ``(T,)`` for T stacked trains of equal shape
(tables looked up together). With stacked trains a rank slice is cut only when it is
dead in every train of the stack.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence, TypeVar

import torch
from torch import nn

from comera_rec.tensor.derived import clear_derived_caches, derived_cache


def check_rank(name: str, rank: int | Sequence[int], num_bonds: int) -> list[int]:
    """Expand an int rank to one rank per internal bond and validate it."""
    ranks = [rank] * num_bonds if isinstance(rank, int) else list(rank)
    if len(ranks) != num_bonds:
        raise ValueError(f"{name}: expected {num_bonds} ranks (one per internal bond), got {ranks}")
    for r in ranks:
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"{name}: rank must be an integer >= 1, got {r!r}")
    return ranks


def check_float_dtype(name: str, dtype: torch.dtype | None) -> torch.dtype:
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise TypeError(f"{name}: dtype must be a floating point type, got {dtype}")
    return dtype


def cap_ranks(ranks: Sequence[int], mode_sizes: Sequence[int]) -> list[int]:
    """Cap each bond's rank at the largest useful value: min(prod of modes left, right)."""
    capped = []
    for k, r in enumerate(ranks):
        left = math.prod(mode_sizes[: k + 1])
        right = math.prod(mode_sizes[k + 1 :])
        capped.append(min(r, left, right))
    return capped


_M = TypeVar("_M", bound=nn.Module)


def _written(p: torch.Tensor) -> bool:
    """Whether ``p`` was modified in place since it was allocated (its version counter)."""
    try:
        return p._version > 0
    except RuntimeError:  # an inference tensor keeps no version counter
        return False


class InitOnMaterialize(nn.Module):
    """Base of modules that initialise themselves when ``apply`` takes them off ``meta``.

    TorchRec's ``DistributedModelParallel`` materialises a model built on the meta device
    with ``model.apply(init_parameters)``: every module's own meta parameters become
    ``torch.empty_like`` tensors (uninitialised memory) and ``reset_parameters`` is called
    only on modules that own a meta parameter *directly*. The parameters of these modules
    live in ``ParameterList`` children (TT cores and controllers, cross-net biases), which
    have no ``reset_parameters``, so DMP would leave them as garbage (huge values or NaN).

    ``nn.Module.apply`` recurses through ``child.apply``, so this override runs inside
    any such call: when the call took this module's parameters off ``meta`` (all of them)
    and some newly allocated parameter has not been written in place since (its version
    counter is 0: nothing initialised it, e.g. DMP called no ``reset_parameters`` here),
    the module calls ``reset_parameters`` once, drawing the same values as a build on the
    target device under the same random state. Values a materialiser writes in place
    (``copy_`` of a checkpoint, its own ``reset_parameters`` call) are kept; a tensor
    swapped in already filled (``zeros_like``, a loaded tensor assigned as is) counts as
    unwritten and is re-initialised. An ``apply`` on a module not on ``meta`` is plain
    ``nn.Module.apply``.
    """

    def apply(self: _M, fn: Callable[[nn.Module], None]) -> _M:
        before = list(self.parameters())
        if not any(p.is_meta for p in before):
            return super().apply(fn)
        kept = [p for p in before if not p.is_meta]  # held, so their ids stay theirs
        kept_ids = {id(p) for p in kept}
        super().apply(fn)
        after = list(self.parameters())
        if after and not any(p.is_meta for p in after):
            if any(id(p) not in kept_ids and not _written(p) for p in after):
                reset = getattr(self, "reset_parameters", None)
                if not callable(reset):
                    raise TypeError(
                        f"{type(self).__name__}: its parameters were allocated off the meta device without "
                        f"values and it has no reset_parameters() to initialise them"
                    )
                with torch.no_grad():
                    reset()
        return self


class TensorTrainModule(InitOnMaterialize):
    """Base for modules whose weight is a tensor train with rank controllers.

    Subclasses register ``cores`` and ``controllers`` with :meth:`_init_train` and
    implement :meth:`dense_num_parameters` and ``reset_parameters`` (called again when
    the module is materialised from ``meta``, see :class:`InitOnMaterialize`). The base
    owns ranks, size accounting, the differentiable size surrogate and physical rank
    truncation.
    """

    cores: nn.ParameterList
    controllers: nn.ParameterList

    def _init_train(
        self,
        core_shapes: Sequence[Sequence[int]],
        num_batch_dims: int,
        controller_shapes: Sequence[Sequence[int]],
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> None:
        self._num_batch_dims = num_batch_dims
        self.cores = nn.ParameterList(
            [nn.Parameter(torch.empty(tuple(s), device=device, dtype=dtype)) for s in core_shapes]
        )
        self.controllers = nn.ParameterList(
            [nn.Parameter(torch.ones(tuple(s), device=device, dtype=dtype)) for s in controller_shapes]
        )

    def train_tensors(self) -> list[torch.Tensor]:
        """The cores, then the controllers, in one list: what every derived value comes from.

        Read from the parameter lists' registries: iterating an ``nn.ParameterList``
        indexes it element by element, ~3 µs a tensor, a large part of a one-row forward.
        """
        return [*self.cores._parameters.values(), *self.controllers._parameters.values()]

    # ------------------------------------------------------------------ ranks
    @property
    def num_cores(self) -> int:
        return len(self.cores)

    @property
    def ranks(self) -> list[int]:
        """Physical rank of every internal bond (what is stored and computed)."""
        return [c.shape[-1] for c in self.controllers]

    def live_mask(self, bond: int, threshold: float) -> torch.Tensor:
        """Bool mask (r_k,) of the live slices of a bond: |D_k| >= threshold in any train."""
        d = self.controllers[bond].detach().abs()
        alive = d >= threshold
        while alive.dim() > 1:
            alive = alive.any(dim=0)
        return alive

    def live_ranks(self, threshold: float = 0.0) -> list[int]:
        """Ranks counting only controller entries of magnitude >= ``threshold``."""
        return [int(self.live_mask(k, threshold).sum()) for k in range(len(self.controllers))]

    # ------------------------------------------------------------------ size
    def _core_mode_size(self, k: int) -> int:
        core = self.cores[k]
        return math.prod(core.shape[self._num_batch_dims + 1 : -1])

    def _num_trains(self) -> int:
        return math.prod(self.cores[0].shape[: self._num_batch_dims])

    def tt_size(self, threshold: float = 0.0) -> int:
        """The method's size S: core entries at the live ranks (TTM column factors counted).

        A train with a bond of no live slice computes zero and counts zero.
        """
        ranks = [1] + self.live_ranks(threshold) + [1]
        if 0 in ranks:
            return 0
        per_train = sum(ranks[k] * self._core_mode_size(k) * ranks[k + 1] for k in range(self.num_cores))
        return per_train * self._num_trains()

    def slice_sizes(self, ranks: Sequence[int]) -> list[int]:
        """Core entries one rank slice of each bond holds at ``ranks``, over all stacked trains.

        A slice of bond ``k`` is a rank row of core ``k`` and of core ``k + 1``:
        ``n_k R_{k-1} + n_{k+1} R_{k+1}`` entries per train (``n`` a core's mode size, TTM
        column factors included; ``R_0 = R_K = 1``). Cutting it frees exactly that.

        Args:
            ranks: one rank per internal bond (e.g. :meth:`live_ranks`).
        """
        padded = [1] + list(ranks) + [1]
        return [
            self._num_trains() * (self._core_mode_size(k) * padded[k] + self._core_mode_size(k + 1) * padded[k + 2])
            for k in range(len(ranks))
        ]

    def size_surrogate(
        self, threshold: float = 0.0, count_as_tensor: bool = False
    ) -> tuple[torch.Tensor, int | torch.Tensor]:
        """Differentiable size surrogate: the L1 norm of the live controller entries.

        Args:
            threshold: entries with ``|D|`` below it are dead and left out.
            count_as_tensor: return the count as a device tensor instead of an int (no host
                synchronisation: capturable in a CUDA graph).

        Returns:
            (sum of |D| over live entries, number of live entries); divide to get the
            reference's mean.
        """
        total = self.controllers[0].new_zeros(())
        count = self.controllers[0].new_zeros(())
        for d in self.controllers:
            live = (d.detach().abs() >= threshold).to(d.dtype)
            total = total + (d.abs() * live).sum()
            count = count + live.sum()
        return total, (count if count_as_tensor else int(count))

    def _extra_num_parameters(self) -> int:
        """Parameters stored beside the train (bias); subclasses override."""
        return 0

    def num_parameters(self, threshold: float = 0.0) -> int:
        """Stored parameters at the live ranks: cores, controllers and any bias."""
        controllers = sum(self.live_ranks(threshold)) * self._num_trains()
        return self.tt_size(threshold) + controllers + self._extra_num_parameters()

    def dense_num_parameters(self) -> int:
        """Parameters of the dense module this one replaces."""
        raise NotImplementedError

    def compression_ratio(self, threshold: float = 0.0) -> float:
        """Dense parameters / live parameters."""
        return self.dense_num_parameters() / max(1, self.num_parameters(threshold))

    # ------------------------------------------------------------------ truncation
    @torch.no_grad()
    def kept_indices(self, threshold: float) -> list[torch.Tensor]:
        """Indices of the slices each bond keeps under ``truncate_ranks(threshold)``.

        Live slices (|D| >= threshold in some train); on a bond where none is live, the
        slice of largest magnitude.
        """
        kept = []
        for k in range(len(self.controllers)):
            keep = self.live_mask(k, threshold)
            if not bool(keep.any()):
                mags = self.controllers[k].detach().abs()
                while mags.dim() > 1:
                    mags = mags.amax(dim=0)
                keep = torch.zeros_like(keep)
                keep[int(mags.argmax())] = True
            kept.append(keep.nonzero().flatten())
        return kept

    @torch.no_grad()
    def truncate_ranks(self, threshold: float) -> bool:
        """Cut every rank slice whose controller magnitude is below ``threshold``.

        The slice is removed from the controller and from both neighbouring cores, so
        the module stores and computes less; its output changes only by the dead
        slices' contribution (zero when their controllers are zero). At least one slice
        (the largest) survives on every bond. Parameters are replaced by new ones:
        rebuild optimisers and DDP wrappers afterwards.

        Args:
            threshold: slices with |D| < threshold (in every stacked train) are cut.

        Returns:
            True if any rank fell (and parameters were replaced).
        """
        changed = False
        clear_derived_caches(self)  # nothing kept may hold the cores being replaced
        b = self._num_batch_dims
        for k, idx in enumerate(self.kept_indices(threshold)):
            if idx.numel() == self.controllers[k].shape[-1]:
                continue
            left, right, ctrl = self.cores[k], self.cores[k + 1], self.controllers[k]
            self.cores[k] = nn.Parameter(left.index_select(left.dim() - 1, idx).contiguous())
            self.cores[k + 1] = nn.Parameter(right.index_select(b, idx).contiguous())
            self.controllers[k] = nn.Parameter(ctrl.index_select(ctrl.dim() - 1, idx).contiguous())
            changed = True
        return changed

    # ------------------------------------------------------------------ helpers
    def scaled_cores(self) -> list[torch.Tensor]:
        """Cores with each controller folded in: ``G_k D_k G_{k+1}`` as ``(G_k D_k) G_{k+1}`` or
        ``G_k (D_k G_{k+1})``, whichever of the two cores is smaller (the product is the same;
        scaling a large core costs a pass over it forward and two backward).

        Without gradients the result is kept until a core or controller changes
        (:class:`~comera_rec.tensor.derived.DerivedCache`), so scoring does not fold the
        controllers again on every batch."""
        # a copy of the kept list: a caller may change its own
        return list(derived_cache(self, "scaled_cores").get(self.train_tensors(), self._fold_controllers))

    def _fold_controllers(self, skip: int | None = None) -> list[torch.Tensor]:
        """The cores with every controller folded in but bond ``skip``'s (if given)."""
        out = list(self.cores)
        for k, d in enumerate(self.controllers):
            if k == skip:
                continue
            left, right = out[k], out[k + 1]
            batch, r = d.shape[:-1], d.shape[-1:]
            if self.cores[k + 1].numel() < self.cores[k].numel():
                # (*batch, r) -> (*batch, r, 1, ..., 1) to scale core k + 1's first rank dim
                out[k + 1] = right * d.reshape(batch + r + (1,) * (right.dim() - d.dim()))
            else:
                # (*batch, r) -> (*batch, 1, ..., 1, r) to scale core k's last rank dim
                out[k] = left * d.reshape(batch + (1,) * (left.dim() - d.dim()) + r)
        return out

    @torch.no_grad()
    def _init_cores_normal(self, target_std: float, generator: torch.Generator | None = None) -> None:
        """Draw cores so that the reconstructed weight has entries of std ``target_std``.

        An entry of the weight is a sum over prod(r_k) rank paths of products of K
        core entries, so each core gets std (target_std^2 / prod(r_k))^(1 / 2K).
        """
        paths = math.prod(self.ranks)
        std = (target_std**2 / paths) ** (1.0 / (2 * self.num_cores))
        for core in self.cores:
            if core.is_meta:
                continue
            core.normal_(0.0, std, generator=generator)
        for d in self.controllers:
            if not d.is_meta:
                d.fill_(1.0)


def tensor_train_modules(model: nn.Module) -> Iterator[tuple[str, TensorTrainModule]]:
    """All tensor-train submodules of ``model`` with their qualified names."""
    for name, module in model.named_modules():
        if isinstance(module, TensorTrainModule):
            yield name, module


def parameter_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Split ``model``'s trainable parameters into cores, controllers and the rest.

    The method trains the three with different learning rates.

    Example::

        >>> from comera_rec import TTLinear
        >>> groups = parameter_groups(nn.Sequential(TTLinear(16, 16, rank=2), nn.Linear(16, 1)))
        >>> [len(groups[k]) for k in ("cores", "controllers", "other")]
        [4, 3, 3]
    """
    cores: dict[int, nn.Parameter] = {}
    controllers: dict[int, nn.Parameter] = {}
    for _, module in tensor_train_modules(model):
        for p in module.cores:
            cores[id(p)] = p
        for p in module.controllers:
            controllers[id(p)] = p
    other = [p for p in model.parameters() if p.requires_grad and id(p) not in cores and id(p) not in controllers]
    return {"cores": list(cores.values()), "controllers": list(controllers.values()), "other": other}
