"""PairwiseDotInteraction against TorchRec's InteractionArch (float64), gradcheck, and its
use in the DLRM builder."""

from __future__ import annotations

import pytest
import torch
from torchrec.models.dlrm import InteractionArch

from dlrm import DLRMConfig, build_dlrm, build_dlrm_train
from dlrm.interaction import PairwiseDotInteraction

from tests.dlrm.test_dlrm import _batch, _config


@pytest.mark.parametrize("features,dim,batch", [(1, 4, 3), (5, 3, 7), (26, 16, 9)])
def test_equals_torchrec_interaction(features: int, dim: int, batch: int) -> None:
    g = torch.Generator().manual_seed(features)
    dense = torch.randn(batch, dim, generator=g, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(batch, features, dim, generator=g, dtype=torch.float64, requires_grad=True)
    ours = PairwiseDotInteraction(features)(dense, sparse)
    theirs = InteractionArch(features)(dense, sparse)
    assert torch.equal(ours, theirs)  # the same GEMM and the same picks: bit for bit
    grad = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(ours, [dense, sparse], grad), torch.autograd.grad(theirs, [dense, sparse], grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, 4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(PairwiseDotInteraction(4), (dense, sparse))


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="at least one sparse feature"):
        PairwiseDotInteraction(0)
    with pytest.raises(ValueError, match=r"expected sparse features \(B, 3, D\), got \(2, 4, 5\)"):
        PairwiseDotInteraction(3)(torch.randn(2, 5), torch.randn(2, 4, 5))


@pytest.mark.parametrize("compressed", [False, True])
def test_builder_swaps_the_interaction_and_keeps_the_loss(compressed: bool) -> None:
    torch.manual_seed(0)
    plain = build_dlrm_train(_config(compressed=compressed))
    torch.manual_seed(0)
    fused = build_dlrm_train(_config(compressed=compressed, fused_interaction=True))
    assert isinstance(fused.model.inter_arch, PairwiseDotInteraction)
    assert not isinstance(plain.model.inter_arch, PairwiseDotInteraction)
    batch = _batch()
    loss_plain, _ = plain(batch)
    loss_fused, _ = fused(batch)
    assert torch.equal(loss_plain, loss_fused)
    loss_plain.backward()
    loss_fused.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fused_interaction_needs_the_dot_interaction() -> None:
    with pytest.raises(ValueError, match="fused_interaction replaces the 'dot' interaction"):
        build_dlrm(DLRMConfig(table_sizes=[100, 50], embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1],
                              interaction="dcn", fused_interaction=True), device="meta")


def test_builds_on_meta_and_holds_no_state() -> None:
    model = build_dlrm(_config(compressed=False, fused_interaction=True), device="meta")
    assert isinstance(model.inter_arch, PairwiseDotInteraction)
    assert dict(model.inter_arch.state_dict()) == {}
