"""Training methods compared in one harness: compressed (CoMERA), dense, GaLore and LTE.

- **compressed**: the TT / TTM model under the rank-adaptive schedule.
- **dense**: the dense twin, every parameter trained by the engine's optimiser.
- **GaLore**: the dense twin; the 2-D weights of the encoder's linear layers are updated
  by ``galore_torch.GaLoreAdamW`` (gradients projected onto a rank-``galore_rank``
  subspace refreshed every ``update_proj_gap`` steps), everything else by the engine's
  optimiser. The package is imported only when this method is chosen.
- **LTE** (parallel low-rank adapters, arXiv 2402.16828): every encoder linear layer keeps
  a frozen dense weight ``W`` and ``N`` LoRA heads ``(A_i, B_i)``. Head ``i`` sees the
  ``i``-th slice of the batch, so the heads are trained independently as on N workers;
  every ``lte_merge_every`` steps their mean update is merged into ``W``
  (``W += (s / N) sum_i B_i A_i``), the ``B_i`` are reset to zero and the adapters'
  optimiser state is cleared.

The engine drives all four: the method decides which parameters its torch optimiser
updates (``optimizer_parameters``) and which extra optimisers it steps (GaLore's, the
LTE adapters' with the merge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

METHODS = ("compressed", "dense", "galore", "lte")


@dataclass
class MethodConfig:
    """Which training method runs, and the settings of the GaLore and LTE baselines."""

    name: Literal["compressed", "dense", "galore", "lte"] = "compressed"
    """"compressed" (TT / TTM model, rank-adaptive), "dense", "galore" or "lte"."""
    galore_rank: int = 128
    """GaLore: rank of the gradient projection."""
    galore_update_proj_gap: int = 200
    """GaLore: steps between refreshes of the projection (an SVD of the gradient)."""
    galore_scale: float = 0.25
    """GaLore: scale of the projected-back update."""
    galore_proj_type: str = "std"
    """GaLore: projection side ("std", "reverse_std", "left", "right", "full")."""
    galore_lr: float = 1e-3
    """GaLore: learning rate of the projected weights (others use the engine's lr_other)."""
    lte_heads: int = 4
    """LTE: parallel adapter heads per layer (each trained on 1/heads of the batch)."""
    lte_rank: int = 16
    """LTE: rank of every adapter head."""
    lte_alpha: float = 32.0
    """LTE: adapter scale s = lte_alpha / lte_rank."""
    lte_merge_every: int = 10
    """LTE: optimiser steps between merges of the heads into the frozen weights."""
    lte_lr: float = 1e-3
    """LTE: learning rate of the adapters (others use the engine's lr_other)."""

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"MethodConfig.name must be one of {METHODS}, got {self.name!r}")
        for name in ("galore_rank", "galore_update_proj_gap", "lte_heads", "lte_rank", "lte_merge_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MethodConfig.{name} must be a positive integer, got {value!r}")
        for name in ("galore_scale", "galore_lr", "lte_alpha", "lte_lr"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0 or not math.isfinite(value):
                raise ValueError(f"MethodConfig.{name} must be a finite number > 0, got {value!r}")

    @property
    def compressed(self) -> bool:
        return self.name == "compressed"


def encoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The dense Q/K/V/output and FFN layers of every encoder block (what GaLore and LTE act on)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{name}"]


# ----------------------------------------------------------------------------- GaLore


class GaLoreOptimizer:
    """``galore_torch.GaLoreAdamW`` over given 2-D weights, with a checkpointable state.

    GaLore keeps a projector object per weight; :meth:`state_dict` stores only its
    projection matrix (a tensor), so checkpoints load with ``weights_only=True``.

    Args:
        params: the 2-D weights to project.
        lr: learning rate.
        rank: projection rank.
        update_proj_gap: steps between projection refreshes.
        scale: scale of the projected-back update.
        proj_type: GaLore projection type.
        weight_decay: decoupled weight decay.

    Example::

        >>> w = nn.Parameter(torch.randn(16, 8))
        >>> opt = GaLoreOptimizer([w], lr=1e-2, rank=2, update_proj_gap=10, scale=0.25)  # doctest: +SKIP
        >>> (w.sum() ** 2).backward(); opt.step()  # doctest: +SKIP
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        lr: float,
        rank: int,
        update_proj_gap: int,
        scale: float,
        proj_type: str = "std",
        weight_decay: float = 0.0,
    ) -> None:
        try:
            from galore_torch import GaLoreAdamW
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the GaLore baseline needs the galore-torch package: pip install 'comera-rec[baselines]'"
            ) from e
        params = list(params)
        if not params:
            raise ValueError("GaLoreOptimizer: no parameters to optimise")
        for p in params:
            if p.dim() != 2:
                raise ValueError(f"GaLoreOptimizer: GaLore projects 2-D weights, got shape {tuple(p.shape)}")
        group = {
            "params": params,
            "rank": rank,
            "update_proj_gap": update_proj_gap,
            "scale": scale,
            "proj_type": proj_type,
        }
        self.inner = GaLoreAdamW([group], lr=lr, weight_decay=weight_decay, no_deprecation_warning=True)
        self.param_groups = self.inner.param_groups

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        sd = self.inner.state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # copies: the live state keeps its projectors
        for state in sd["state"].values():
            proj = state.pop("projector", None)
            if proj is not None:
                ortho = proj.ortho_matrix
                if isinstance(ortho, (list, tuple)):
                    state["projector_left"], state["projector_right"] = ortho
                elif ortho is not None:
                    state["projector_matrix"] = ortho
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from galore_torch.galore_projector import GaLoreProjector

        sd = {"state": {k: dict(v) for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
        saved = {}
        for key, state in sd["state"].items():
            if "projector_matrix" in state:
                saved[key] = state.pop("projector_matrix")
            elif "projector_left" in state:
                saved[key] = [state.pop("projector_left"), state.pop("projector_right")]
        self.inner.load_state_dict(sd)
        group = self.inner.param_groups[0]
        for key, ortho in saved.items():
            p = group["params"][int(key)]
            proj = GaLoreProjector(
                group["rank"],
                update_proj_gap=group["update_proj_gap"],
                scale=group["scale"],
                proj_type=group["proj_type"],
            )
            proj.ortho_matrix = ortho
            self.inner.state[p]["projector"] = proj


# ----------------------------------------------------------------------------- LTE


class LTELinear(nn.Module):
    """A frozen dense layer with ``heads`` parallel LoRA adapters, one per batch slice.

    ``y_i = x_i W^T + b + s * x_i A_i^T B_i^T`` for the i-th slice ``x_i`` of the batch
    (dimension 0), ``s = alpha / rank``. ``A_i`` start random, ``B_i`` at zero, so a
    fresh layer equals its dense weight. :meth:`merge` folds the heads' mean update
    into ``W``.

    Args:
        weight: ``(out, in)`` initial weight (copied, frozen).
        bias: ``(out,)`` initial bias (trainable) or ``None``.
        heads: number of adapter heads N.
        rank: rank of each head.
        alpha: scale numerator.

    Example::

        >>> lin = nn.Linear(8, 4)
        >>> lte = LTELinear.from_linear(lin, heads=2, rank=2)
        >>> x = torch.randn(6, 8)
        >>> torch.allclose(lte(x), lin(x))
        True
    """

    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor], *, heads: int, rank: int, alpha: float
    ) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        self.heads, self.rank = heads, rank
        self.scale = alpha / rank
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.lora_a = nn.Parameter(torch.empty(heads, rank, in_features, dtype=weight.dtype, device=weight.device))
        self.lora_b = nn.Parameter(torch.zeros(heads, out_features, rank, dtype=weight.dtype, device=weight.device))
        self.reset_adapters(reinit_a=True)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, heads: int, rank: int, alpha: float = 32.0) -> "LTELinear":
        """Wrap an ``nn.Linear``'s weights (copied)."""
        return cls(linear.weight, linear.bias, heads=heads, rank=rank, alpha=alpha)

    @torch.no_grad()
    def reset_adapters(self, reinit_a: bool = False) -> None:
        """Zero every ``B_i`` (and redraw ``A_i`` like LoRA when ``reinit_a``)."""
        if reinit_a:
            bound = 1.0 / math.sqrt(self.in_features)
            self.lora_a.uniform_(-bound, bound)
        self.lora_b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, ..., in)`` -> ``(B, ..., out)``; head i adapts the i-th slice of dim 0."""
        base = F.linear(x, self.weight, self.bias)
        slices = torch.tensor_split(x, self.heads, dim=0)  # N slices (some empty when B < N)
        updates = []
        for i, xs in enumerate(slices):
            if xs.shape[0] == 0:
                continue
            updates.append((xs @ self.lora_a[i].t()) @ self.lora_b[i].t())  # (b_i, ..., r) -> (b_i, ..., out)
        return base + self.scale * torch.cat(updates, dim=0)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + (s / N) sum_i B_i A_i``: the frozen weight with the heads' mean update."""
        delta = torch.einsum("nor,nri->oi", self.lora_b, self.lora_a)  # sum over heads
        return self.weight + (self.scale / self.heads) * delta

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the heads into ``W`` (in place) and zero every ``B_i``."""
        self.weight.copy_(self.merged_weight())
        self.reset_adapters()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, heads={self.heads}, "
            f"rank={self.rank}, scale={self.scale:g}"
        )


def to_lte(model: nn.Module, *, heads: int, rank: int, alpha: float) -> nn.Module:
    """Replace the encoder's dense linear layers by :class:`LTELinear` (in place).

    Example::

        >>> from comera_rec.transformer.config import EncoderConfig
        >>> from comera_rec.transformer.model import SequenceClassifier
        >>> m = to_lte(SequenceClassifier(EncoderConfig(vocab_size=50, num_layers=1, d_model=16, num_heads=2, d_ff=32, compressed=False)), heads=2, rank=2, alpha=4)
        >>> sum(isinstance(x, LTELinear) for x in m.modules())
        6
    """
    for name, linear in encoder_linears(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LTELinear.from_linear(linear, heads=heads, rank=rank, alpha=alpha))
    return model


def lte_layers(model: nn.Module) -> list[LTELinear]:
    return [m for m in model.modules() if isinstance(m, LTELinear)]


class LTEOptimizer:
    """AdamW over the LTE adapters that merges the heads every ``merge_every`` steps.

    After each merge the ``B_i`` are zero and the adapters' AdamW state is cleared, so
    every round of local steps starts from the merged weights.

    Args:
        model: a model holding :class:`LTELinear` layers.
        lr: adapter learning rate.
        merge_every: optimiser steps between merges.
        weight_decay: decoupled weight decay of the adapters.
    """

    def __init__(self, model: nn.Module, *, lr: float, merge_every: int, weight_decay: float = 0.0) -> None:
        self.layers = lte_layers(model)
        if not self.layers:
            raise ValueError("LTEOptimizer: the model has no LTELinear layers (call to_lte first)")
        params = [p for layer in self.layers for p in (layer.lora_a, layer.lora_b)]
        self.inner = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.param_groups = self.inner.param_groups
        self.merge_every = merge_every
        self.steps = 0
        self.merges = 0

    def step(self) -> None:
        self.inner.step()
        self.steps += 1
        if self.steps % self.merge_every == 0:
            self.merge()

    def merge(self) -> None:
        """Merge every layer's heads now and clear the adapters' optimiser state."""
        for layer in self.layers:
            layer.merge()
        self.inner.state.clear()
        self.merges += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "steps": self.steps, "merges": self.merges}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inner.load_state_dict(sd["inner"])
        self.steps, self.merges = int(sd["steps"]), int(sd["merges"])


# ----------------------------------------------------------------------------- wiring


def prepare_model(model: nn.Module, method: MethodConfig) -> nn.Module:
    """Turn a freshly built dense model into the method's model (LTE adapters; others as is)."""
    if method.name == "lte":
        return to_lte(model, heads=method.lte_heads, rank=method.lte_rank, alpha=method.lte_alpha)
    return model


def engine_parameters(model: nn.Module, method: MethodConfig) -> list[nn.Parameter]:
    """The parameters the engine's torch optimiser updates under ``method``.

    GaLore's projected weights and LTE's adapters are left to :func:`extra_optimizers`;
    LTE's frozen weights to nobody.
    """
    if method.name == "galore":
        taken = {id(linear.weight) for _, linear in encoder_linears(model)}
    elif method.name == "lte":
        taken = {id(p) for layer in lte_layers(model) for p in (layer.lora_a, layer.lora_b)}
    else:
        taken = set()
    return [p for p in model.parameters() if p.requires_grad and id(p) not in taken]


def extra_optimizers(model: nn.Module, method: MethodConfig) -> list[Any]:
    """The method's own optimisers, stepped by the engine after its torch optimiser."""
    if method.name == "galore":
        projected = [linear.weight for _, linear in encoder_linears(model)]
        return [
            GaLoreOptimizer(
                projected,
                lr=method.galore_lr,
                rank=method.galore_rank,
                update_proj_gap=method.galore_update_proj_gap,
                scale=method.galore_scale,
                proj_type=method.galore_proj_type,
            )
        ]
    if method.name == "lte":
        return [LTEOptimizer(model, lr=method.lte_lr, merge_every=method.lte_merge_every)]
    return []
