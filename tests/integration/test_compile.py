"""``torch.compile`` over a compressed TorchRec model's dense parts, as a user compiles them:
each part is one graph that calls the fused CPU kernels as operators (nothing of the scoring
caches is traced), and the compiled model gives the eager model's loss and gradients."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import comera_rec
from tests.integration import pipelines_worker as worker
from tests.tensor.test_compiled_ops import recording_backend


def loss_and_grads(model: torch.nn.Module, step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss, _ = model(worker.dcn_batch(step))
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), list(torch.autograd.grad(loss, params))


def test_compiled_dense_parts_are_whole_graphs_and_match_eager() -> None:
    torch._dynamo.reset()
    model = worker.dcn_model(worker.CPU)
    comera_rec.compress(model, worker.POLICY)
    assert worker.tt_names(model.model.dense_arch) and worker.tt_names(model.model.over_arch)
    eager = [loss_and_grads(model, step) for step in range(2)]
    dlrm = model.model
    # dynamo and AOT autograd as inductor runs them, without compiling C++
    names: set[str] = set()
    dlrm.dense_arch = torch.compile(dlrm.dense_arch, backend=recording_backend(names))
    dlrm.inter_arch = torch.compile(dlrm.inter_arch, backend=recording_backend(names))
    dlrm.over_arch = torch.compile(dlrm.over_arch, backend=recording_backend(names))
    try:
        counters.clear()
        for step, (loss, grads) in enumerate(eager):
            got_loss, got_grads = loss_and_grads(model, step)
            torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-7)
            for got, want in zip(got_grads, grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        # one graph per part: no graph break (the making of a scoring cache's lock was one,
        # in every TT layer, 31 in these two steps)
        assert counters["stats"]["unique_graphs"] == 3
        assert not counters["graph_break"], list(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    # the graphs call the fused CPU kernels as operators (each way): the MLPs' chains of TT
    # layers and the TT weights' merges (the pairwise-dot interaction: tests/dlrm/test_interaction.py)
    for op in ("tt_chain", "tt_chains"):
        assert {f"comera_train.{op}.default", f"comera_train.{op}_backward.default"} <= names, sorted(names)
