"""TT modules initialise themselves when ``apply`` takes them off the meta device, and only then."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_rec import TTLinear, TTMEmbeddingBag
from comera_rec.tensor.stacked import StackedTTMTables


@torch.no_grad()
def allocate_empty(module: nn.Module) -> None:
    """What TorchRec's ``DistributedModelParallel`` applies to a meta model: its own meta
    parameters become ``torch.empty_like`` tensors, and ``reset_parameters`` is called
    only where the module owned one of them directly."""
    owned = False
    for name, p in module._parameters.items():
        if p is not None and p.is_meta:
            module._parameters[name] = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
            owned = True
    if owned and hasattr(module, "reset_parameters"):
        module.reset_parameters()


BUILDS = {
    "ttm_bag": lambda device: TTMEmbeddingBag(60, 4, 3, shape=((6, 10), (2, 2)), device=device),
    "stacked": lambda device: StackedTTMTables([60, 40], 4, 3, row_shape=(6, 10), col_shape=(2, 2), device=device),
    "tt_linear": lambda device: TTLinear(12, 8, 3, device=device),
    "tt_linear_no_bias": lambda device: TTLinear(12, 8, 3, bias=False, device=device),
}


@pytest.mark.parametrize("kind", BUILDS)
def test_apply_off_meta_gives_the_cpu_build(kind: str) -> None:
    torch.manual_seed(3)
    reference = BUILDS[kind]("cpu")
    module = nn.Sequential(BUILDS[kind]("meta"))  # reached through a parent's apply, as in a model
    torch.manual_seed(3)
    module.apply(allocate_empty)
    for (name, got), (_, want) in zip(module[0].state_dict().items(), reference.state_dict().items()):
        assert torch.equal(got, want), name


def test_apply_on_a_materialised_module_changes_nothing() -> None:
    module = TTLinear(12, 8, 3)
    with torch.no_grad():
        module.controllers[0].mul_(0.5)  # trained state: not what reset_parameters gives
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.apply(allocate_empty)
    module.apply(lambda m: None)
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_apply_that_leaves_meta_does_nothing() -> None:
    module = TTMEmbeddingBag(60, 4, 3, shape=((6, 10), (2, 2)), device="meta")
    module.apply(lambda m: None)
    assert all(p.is_meta for p in module.parameters())


def test_values_written_by_the_materialiser_are_kept() -> None:
    source = TTMEmbeddingBag(60, 4, 3, shape=((6, 10), (2, 2)))
    with torch.no_grad():
        source.controllers[0].fill_(0.25)
    state = source.state_dict()
    module = TTMEmbeddingBag(60, 4, 3, shape=((6, 10), (2, 2)), device="meta")
    prefix = {id(m): name for name, m in module.named_modules()}

    @torch.no_grad()
    def load(m: nn.Module) -> None:  # allocate, then copy loaded values in
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.empty_like(p, device="cpu"))
                new.copy_(state[f"{prefix[id(m)]}.{name}".lstrip(".")])
                m._parameters[name] = new

    module.apply(load)
    for name, value in module.state_dict().items():
        assert torch.equal(value, state[name]), name
