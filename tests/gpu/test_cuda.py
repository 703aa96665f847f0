"""Tests that need CUDA (skipped without it); run by ``python -m comera_rec.gpu_check``.

Written without a GPU: none of these has run yet (docs/gpu.md, "Validating a GPU machine").
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_rec.tensor import TTMEmbeddingBag, kernels, set_static_shapes
from comera_rec.tensor.contract import ttm_embedding_bag
from comera_rec.training import OptimConfig, build_optimizer
from comera_rec.training.cuda_graph import CudaGraphCapture, GraphedTrainStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def _cores(rank: int = 32, n: int = 60, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, n, 2, rank), (rank, n, 2, rank), (rank, n, 2, rank), (rank, n, 2, 1)]
    return [(torch.randn(2, *s, generator=g) * 0.3).to(CUDA).requires_grad_() for s in shapes]


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_triton_lookup_matches_torch_path_on_cuda(mode: str) -> None:
    pytest.importorskip("triton")
    cores = _cores()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 60**4, (50000,), generator=g).to(CUDA)
    trains = torch.randint(0, 2, (50000,), generator=g).to(CUDA)
    offsets = torch.arange(0, 50001, 5).to(CUDA)
    results = []
    for fused in (True, False):
        kernels.set_triton_enabled(fused)
        try:
            out = ttm_embedding_bag(cores, (60,) * 4, 16, ids, offsets, mode, None, trains)
            grads = torch.autograd.grad(out.square().sum(), cores)
        finally:
            kernels.set_triton_enabled(True)
        results.append((out, grads))
    (out, grads), (ref, ref_grads) = results
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= 1e-4 * scale
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": TTMEmbeddingBag(24, 4, rank=2, shape=((4, 6), (2, 2))), "head": nn.Linear(7, 1)})
    set_static_shapes(model)
    return model.to(CUDA)


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer):
    offsets = torch.arange(0, 9, 2, device=CUDA)

    def step(b: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.cat([model["emb"](b["ids"], offsets), b["dense"]], dim=1)
        loss = F.binary_cross_entropy_with_logits(model["head"](h).squeeze(1), b["y"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_cuda_graph_step_equals_eager_step(name: str) -> None:
    cfg = OptimConfig(name=name, lr_cores=0.05, lr_controllers=0.05, lr_other=0.05, momentum=0.9)
    eager_model, graph_model = _tiny_model(), _tiny_model()
    eager_step = _step_fn(eager_model, build_optimizer(eager_model, cfg, capturable=True))
    graphed = GraphedTrainStep(
        _step_fn(graph_model, build_optimizer(graph_model, cfg, capturable=True)), capture=CudaGraphCapture(CUDA)
    )
    g = torch.Generator().manual_seed(3)
    for _ in range(8):
        b = {
            "ids": torch.randint(0, 24, (8,), generator=g).to(CUDA),
            "dense": torch.randn(4, 3, generator=g).to(CUDA),
            "y": torch.randint(0, 2, (4,), generator=g).float().to(CUDA),
        }
        torch.testing.assert_close(graphed(b).clone(), eager_step(b), rtol=1e-5, atol=1e-6)
    assert graphed.captures == 1 and graphed.replays >= 1
    for (k, a), b in zip(eager_model.state_dict().items(), graph_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


def _nccl_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    x = torch.full((4,), float(rank + 1), device=f"cuda:{rank}")
    dist.all_reduce(x)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(5, 1).to(rank), device_ids=[rank])
    g = torch.Generator().manual_seed(7)
    inputs, targets = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
    part = slice(rank * 8 // world, (rank + 1) * 8 // world)
    F.mse_loss(model(inputs[part].to(rank)), targets[part].to(rank)).backward()
    torch.save({"sum": x.cpu(), "grad": model.module.weight.grad.cpu()}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_nccl_two_process_all_reduce(tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp

    mp.start_processes(
        _nccl_worker, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    ref = nn.Linear(5, 1)
    g = torch.Generator().manual_seed(7)
    inputs, targets = torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)
    F.mse_loss(ref(inputs), targets).backward()
    for r in ranks:
        assert torch.equal(r["sum"], torch.full((4,), 3.0))
        torch.testing.assert_close(r["grad"], ref.weight.grad, rtol=1e-5, atol=1e-6)
