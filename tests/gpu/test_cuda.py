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


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_scoring_on_cuda_keeps_halves_and_chains_and_equals_float64(mode: str) -> None:
    """Scoring inside ``cached_weights``: the Triton lookup over kept whole halves and the TT
    layer over kept merged chains equal float64 references; a second call keeps them."""
    pytest.importorskip("triton")
    from comera_rec.tensor import TTLinear, cached_weights
    from comera_rec.tensor.kernels import ttm_triton

    cores = [c.detach() for c in _cores(rank=16, n=30)]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 30**4, (4096,), generator=g).to(CUDA)
    trains = torch.randint(0, 2, (4096,), generator=g).to(CUDA)
    offsets = torch.arange(0, 4097, 4).to(CUDA)
    ref = ttm_embedding_bag(
        [c.double().cpu() for c in cores], (30,) * 4, 16, ids.cpu(), offsets.cpu(), mode, None, trains.cpu()
    )
    layer = TTLinear(512, 256, rank=16).to(CUDA)
    x = torch.randn(64, 512, device=CUDA)
    layer_ref = x.double() @ layer.dense_weight().double().t() + layer.bias.double()
    with torch.no_grad(), cached_weights():
        for call in range(2):
            out = ttm_embedding_bag(cores, (30,) * 4, 16, ids, offsets, mode, None, trains)
            assert ttm_triton.scoring_halves(cores) is not None, f"call {call}: halves not kept"
            torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-4)
            y = layer(x)
            torch.testing.assert_close(y.double(), layer_ref, rtol=1e-4, atol=1e-4)


def test_bad_bags_on_cuda_are_named() -> None:
    """The checks read a CUDA batch in one copy; what is wrong is still named."""
    bag = TTMEmbeddingBag(100, 8, rank=2).to(CUDA)
    ok = torch.tensor([0, 2], device=CUDA)
    assert bag(torch.tensor([5, 99], device=CUDA), ok).shape == (1, 8)
    with pytest.raises(ValueError, match="id 100 is out of range for num_embeddings=100"):
        bag(torch.tensor([5, 100], device=CUDA), ok)
    with pytest.raises(ValueError, match="id -1 is negative"):
        bag(torch.tensor([-1, 5], device=CUDA), ok)
    with pytest.raises(ValueError, match=r"non-decreasing.*offsets\[2\]=1"):
        bag(torch.tensor([1, 2, 3], device=CUDA), torch.tensor([0, 2, 1, 3], device=CUDA))


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


class _Tiny(nn.Module):
    """``_tiny_model`` as one module with a forward (DDP prepares its reduction in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = _tiny_model()
        set_static_shapes(self, False)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.parts["head"](torch.cat([self.parts["emb"](ids, offsets), dense], dim=1))


def test_nccl_one_process_ddp_follows_a_rank_cut(tmp_path) -> None:
    """nccl on one GPU: DDP over TT modules reduces every gradient, before and after a rank
    cut with the wrapper rebuilt (world size 1: the gradients equal the unwrapped model's)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from comera_rec.rank.truncation import truncate_model

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.full((3,), 2.0, device=CUDA)
        dist.all_reduce(x)
        assert torch.equal(x.cpu(), torch.full((3,), 2.0))
        model, reference = _Tiny(), _Tiny()
        inputs = (torch.tensor([1, 5, 23, 7, 0, 2, 9, 11]), torch.arange(0, 9, 2), torch.randn(4, 3))
        inputs = tuple(t.to(CUDA) for t in inputs)
        for cut in (False, True):
            if cut:
                for m in (model, reference):
                    with torch.no_grad():
                        m.parts["emb"].controllers[0][1:] = 0.0
                    assert truncate_model(m, 1e-3).changed
            wrapped = DistributedDataParallel(model, device_ids=[0])
            model.zero_grad(), reference.zero_grad()
            wrapped(*inputs).square().sum().backward()
            reference(*inputs).square().sum().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert p.shape == q.shape and p.grad is not None, name
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
            del wrapped
    finally:
        dist.destroy_process_group()


def test_graphed_lookup_step_equals_eager_at_kaggle_table_size() -> None:
    """The whole lookup step (Triton static lookup, backward, Adagrad) as one CUDA graph
    gives the eager step's losses and cores, on a 10M-row Kaggle table."""
    pytest.importorskip("triton")
    from launch.bench_gpu import build_lookup, lookup_batch

    sizes = [10131227, 93145]
    (eager_model, eager), (graph_model, graphed) = (
        build_lookup(k, sizes, 8, CUDA) for k in ("tt_triton", "tt_graphed")
    )
    for seed in range(6):
        batch = lookup_batch(sizes, 256, CUDA, seed)
        torch.testing.assert_close(graphed(batch).clone(), eager(batch), rtol=1e-4, atol=1e-4)
    assert graphed.captures == 1 and graphed.replays >= 1
    for (k, a), b in zip(eager_model.state_dict().items(), graph_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=k)


def test_bench_gpu_quick_runs_on_cuda() -> None:
    from launch.bench_gpu import main

    main(["--quick", "--device", "cuda"])


def _transformer_data():
    from comera_rec.transformer.data import PairDataset, synthetic_nli
    from comera_rec.transformer.tokenizer import train_wordpiece

    ex = synthetic_nli(96, seed=0)
    tok = train_wordpiece(ex.firsts + ex.seconds, vocab_size=120)
    return PairDataset.from_examples(tok, ex, 32), tok.get_vocab_size()


def _transformer_run(tmp_path, data, graphed: bool, capture=None):
    """A tiny TT transformer on CUDA through budget cuts, eager or as CUDA graphs."""
    from comera_rec.rank import RankScheduleConfig
    from comera_rec.training import TrainerConfig
    from comera_rec.transformer.baselines import MethodConfig
    from comera_rec.transformer.config import encoder_preset
    from comera_rec.transformer.tasks import ClassificationTask, TransformerTrainer

    torch.manual_seed(0)
    ds, vocab = data
    cfg = encoder_preset("tiny").replace(vocab_size=vocab, max_len=32, rank=8, embedding_rank=8, dropout=0.0)
    task = ClassificationTask(cfg, MethodConfig("compressed"), ds, ds, batch_size=8, fixed_width=True)
    trainer_cfg = TrainerConfig(
        run_dir=str(tmp_path / f"graphed{graphed}"),
        max_steps=24,
        progress=False,
        plots=False,
        checkpoint_at_end=False,
        eval_every=12,
        device="cuda",
        cuda_graphs=graphed,
    )
    schedule = RankScheduleConfig(mode="budget", target_size_ratio=0.5, prune_start=0.2, prune_end=0.6)
    optim = OptimConfig(name="Adam", lr_cores=1e-2, lr_controllers=1e-2, lr_other=1e-2)
    trainer = TransformerTrainer(task, trainer_cfg, schedule, optim, graph_capture=capture)
    trainer.fit()
    return trainer


def test_transformer_engine_graphed_on_cuda_equals_eager(tmp_path) -> None:
    """The engine's graphed loop on a real GPU (capture, replay, re-capture after a rank
    cut, evaluation in between) trains the TT transformer as the eager loop does."""
    data = _transformer_data()  # once: the tokenizer's training is not deterministic
    eager = _transformer_run(tmp_path, data, False)
    graphed = _transformer_run(tmp_path, data, True)
    assert graphed.truncations == eager.truncations >= 1
    assert len(graphed.losses) == len(eager.losses) == 24
    torch.testing.assert_close(torch.tensor(graphed.losses), torch.tensor(eager.losses), rtol=1e-3, atol=1e-4)
    assert abs(graphed.last_eval["accuracy"] - eager.last_eval["accuracy"]) <= 1 / 96 + 1e-9
    for (k, a), b in zip(eager.model.state_dict().items(), graphed.model.state_dict().values()):
        # a key bias shifts every score of a query alike: softmax cancels it, its gradient is
        # rounding noise, and Adam scales that noise to full steps (different on each path)
        if not k.endswith("attention.key.bias"):
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=k)


def test_token_metrics_on_cuda_logits() -> None:
    from comera_rec.transformer.tasks import TokenMetrics

    metrics = TokenMetrics(CUDA)
    metrics.update(torch.tensor([[2.0, 0.0], [0.0, 1.0]], device=CUDA), torch.tensor([0, 0]))
    assert metrics.compute()["accuracy"] == 0.5 and metrics.compute()["count"] == 2
