"""AdamW for models of many small tensors: torch's fused kernel, one step counter per group.

A compressed model trains many small tensors (the Kaggle DLRM at rank 32: 54, against 14 in
the dense one). ``torch.optim.AdamW(fused=True)`` spends per tensor and step about 17 us
outside its kernel on a 2-core CPU: Python checks and list building for each parameter, and
one ``add_`` for each parameter's step count (``_foreach_add_`` has no fused CPU form). That
was 0.9 ms of the compressed step's 26 ms (docs/performance-history.md). :class:`GroupStepAdamW`
makes the same kernel call with the same arguments: its parameters, moments and results are
bit for bit torch's. Parameters with equal step counts share one count tensor, which is
incremented once a step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# the options the shortcut handles; any other setting steps through torch's own code
_SHORTCUT_OPTIONS = {
    "fused": True,
    "amsgrad": False,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
}


class GroupStepAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose fused step works per group, not per parameter.

    Takes torch's arguments and gives torch's results (the same fused kernel, the same
    arguments), with less work per parameter around the kernel call. Parameters whose step
    counts are equal share one count tensor. ``state_dict`` gives every parameter a count
    of its own, as torch's does, so checkpoints load into either class. Settings the
    shortcut does not cover (not ``fused``, ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable``, a tensor learning rate, parameters on several devices or of several
    dtypes in one group) step through ``torch.optim.AdamW.step`` unchanged.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        **kwargs: ``torch.optim.AdamW``'s options (``fused=True`` for the shortcut).

    Example::

        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = GroupStepAdamW([w], lr=0.1, fused=True)
        >>> w.grad = torch.ones(3)
        >>> opt.step()
        >>> [round(v, 4) for v in w.tolist()]
        [0.899, 0.899, 0.899]
    """

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One AdamW step of every parameter with a gradient (torch's semantics)."""
        if not all(self._shortcut_applies(g) for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _shortcut_applies(self, group: dict) -> bool:
        if any(group.get(key, value) != value for key, value in _SHORTCUT_OPTIONS.items()):
            return False
        if not group["params"]:
            return True
        if isinstance(group["lr"], torch.Tensor):
            return False
        first = group["params"][0]
        return all(
            p.device == first.device and p.dtype == first.dtype and not p.is_complex() and not p.is_sparse
            for p in group["params"]
        )

    def _step_group(self, group: dict) -> None:
        everything = group["params"]
        params = [p for p in everything if p.grad is not None]
        if not params:
            return
        if len(params) < len(everything):
            self._own_counts(p for p in everything if p.grad is None)
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("GroupStepAdamW does not support sparse gradients")
        self._init_states(params)
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        for count in {id(t): t for t in steps}.values():  # each shared count once
            count += 1
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            steps,
            amsgrad=False,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )

    def _init_states(self, params: list[torch.Tensor]) -> None:
        """torch's initial state for parameters without one: zero moments and a step
        count of 0, one count tensor for all of them."""
        fresh = [p for p in params if len(self.state[p]) == 0]
        if fresh:
            # a float32 count, as torch keeps for its fused step
            count = torch.zeros((), dtype=torch.float32, device=fresh[0].device)
            for p in fresh:
                self.state[p].update(
                    step=count,
                    exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                )

    def _own_counts(self, params) -> None:
        """Give these parameters (no gradient this step: their count stays) a count of
        their own where they share one with others."""
        for p in params:
            state = self.state.get(p)
            if state and "step" in state:
                state["step"] = state["step"].clone()

    def _share_equal_counts(self) -> None:
        """Let the parameters of a group whose counts are equal share one count tensor
        (after a load, every parameter has its own)."""
        for group in self.param_groups:
            by_value: dict[tuple, torch.Tensor] = {}
            for p in group["params"]:
                state = self.state.get(p)
                if not state or not isinstance(state.get("step"), torch.Tensor):
                    continue
                step = state["step"]
                key = (float(step), step.device, step.dtype)
                state["step"] = by_value.setdefault(key, step)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then equal step counts of a group shared again."""
        super().load_state_dict(state_dict)
        self._share_equal_counts()

    def state_dict(self) -> dict:
        """torch's state dict, each parameter's step count a tensor of its own (a
        checkpoint loaded in place into a shared count would give every parameter of the
        group the last one's)."""
        out = super().state_dict()
        out["state"] = {
            i: {k: (v.clone() if k == "step" and isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for i, s in out["state"].items()
        }
        return out
