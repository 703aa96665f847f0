"""``RankAdapter``: the budget rank schedule in a training loop this project did not write.

Three lines in a TorchRec loop (DMP or DDP or neither, any optimiser)::

    from comera_rec import RankAdapter
    adapter = RankAdapter(model, total_steps=10_000)           # target: 1/4 of the TT size
    for batch in batches:
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model = adapter.step(model, optimizer)                 # cuts when due

What it does:

* **Costs from gradient hooks.** A hook on every rank controller adds the Fisher cost
  ``(D * dL/dD)^2`` of each slice as soon as its gradient is accumulated (the process's own
  gradient, before DDP averages it), so the loop's order of ``zero_grad`` / ``step`` does
  not matter and nothing is added to the loss. At a cut event the costs are summed over
  the processes, so every process cuts the same slices.
* **Cuts on the budget plan.** :class:`~comera_rec.rank.schedule.RankSchedule` in budget
  mode: the live TT size follows the planned curve from the starting size to the target
  (``target_size_ratio`` of it, default 0.25, or ``target_size_bytes``) between 5% and 40%
  of ``total_steps``, cutting the slices of least cost per byte (docs/rank.md).
* **After a cut,** the smaller parameters replace the old ones in every optimiser passed
  (``torch.optim`` ones, TorchRec's ``KeyedOptimizerWrapper`` / ``CombinedOptimizer``),
  their state sliced to the kept indices
  (:func:`~comera_rec.rank.optim_state.retarget_optimizer`), and the DDP wrapper (inside
  DMP, or a bare one) is rebuilt (:func:`~comera_rec.integration.distributed.rewrap_data_parallel`).
  The sharded tables and their fused optimiser are not touched.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torchrec.distributed.model_parallel import get_unwrapped_module

from comera_rec.integration.distributed import rewrap_data_parallel
from comera_rec.rank.optim_state import retarget_optimizer
from comera_rec.rank.schedule import RankSchedule, RankScheduleConfig
from comera_rec.rank.size import model_tt_bytes
from comera_rec.tensor.train import tensor_train_modules


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DMP / DDP / FSDP wrappers (TorchRec's ``get_unwrapped_module``)."""
    return get_unwrapped_module(model)


class RankAdapter:
    """Budgeted rank adaptation for any training loop (see the module docstring).

    Args:
        model: the model as the loop calls it (DMP, DDP or plain); its TT modules are
            found inside.
        total_steps: optimiser steps the run will take (the plan is laid over them).
        config: the schedule's settings; ``RankScheduleConfig()`` (budget mode, a quarter
            of the starting TT size) when None. Threshold mode is not supported here.

    Raises:
        ValueError: no TT module in ``model``, a ``total_steps`` below 1, or a config
            not in budget mode or with the schedule off.

    Example::

        >>> adapter = RankAdapter(dmp_model, total_steps=5000,  # doctest: +SKIP
        ...                       config=RankScheduleConfig(target_size_ratio=0.1))
        >>> dmp_model = adapter.step(dmp_model, optimizer)  # after each optimiser step  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, total_steps: int, config: Optional[RankScheduleConfig] = None) -> None:
        config = config if config is not None else RankScheduleConfig()
        if not config.enabled or config.mode != "budget":
            raise ValueError(
                f"RankAdapter: needs RankScheduleConfig(mode='budget', enabled=True), got "
                f"mode={config.mode!r}, enabled={config.enabled!r}"
            )
        base = unwrap(model)
        if not any(True for _ in tensor_train_modules(base)):
            raise ValueError(f"RankAdapter: {type(base).__name__} holds no TT module (compress() it first)")
        self.schedule = RankSchedule(config)
        self.schedule.set_total_steps(total_steps)
        self.steps_taken = 0
        self._hooks: list[Any] = []
        self.schedule.maybe_switch(0, base)  # notes the starting size
        self._install_hooks(base)

    # ------------------------------------------------------------------ costs
    def _install_hooks(self, base: nn.Module) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for name, module in tensor_train_modules(base):
            for k, controller in enumerate(module.controllers):
                if controller.requires_grad:
                    self._hooks.append(controller.register_post_accumulate_grad_hook(self._cost_hook(name, k)))

    def _cost_hook(self, name: str, bond: int):
        def hook(controller: nn.Parameter) -> None:
            if self.schedule.stage != "finetune" and controller.grad is not None:
                self.schedule.importance.observe_controller(name, bond, controller)

        return hook

    # ------------------------------------------------------------------ the step
    def step(self, model: nn.Module, *optimizers: Any) -> nn.Module:
        """Count one optimiser step; at a cut event cut, retarget ``optimizers`` and re-wrap.

        Call it on every process after each optimiser step, with every optimiser that
        holds TT parameters (DMP's fused optimiser may be passed too: it holds none).

        Args:
            model: the model as the loop calls it.
            optimizers: the optimisers to keep pointing at the live parameters.

        Returns:
            The model to call from now on: the same object, or a rebuilt bare DDP.
        """
        self.steps_taken += 1
        base = unwrap(model)
        if self.schedule.stage != "finetune":
            self.schedule.importance.steps += 1
        self.schedule.maybe_switch(self.steps_taken, base)
        if not self.schedule.should_truncate(self.steps_taken):
            return model
        self.schedule.importance.all_reduce(base)
        if not self.schedule.truncate(base, self.steps_taken):
            return model
        truncation = self.schedule.last_truncation
        assert truncation is not None
        for opt in optimizers:
            retarget_optimizer(opt, truncation)
        model = rewrap_data_parallel(model)
        self._install_hooks(base)
        return model

    # ------------------------------------------------------------------ reporting, state
    @property
    def last_cuts(self) -> list:
        """The slices cut at the last cut event."""
        return self.schedule.last_cuts

    def size_bytes(self, model: nn.Module) -> int:
        """Bytes of the TT cores at their live ranks (what the target counts)."""
        return model_tt_bytes(unwrap(model), self.schedule.config.threshold)

    def target_bytes(self) -> Optional[int]:
        """The size the plan ends at, in bytes."""
        return self.schedule.target_bytes()

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: the schedule's and the steps taken."""
        return {"schedule": self.schedule.state_dict(), "steps_taken": self.steps_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (resize the model to the checkpoint's ranks first)."""
        self.schedule.load_state_dict(state["schedule"])
        self.steps_taken = int(state["steps_taken"])

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
