"""The compressed TorchRec DLRM on CUDA (skipped without CUDA or TorchRec).

The model is moved to the GPU as one module, without ``wrap_model`` (whose dense tables
need FBGEMM's CUDA kernels): the compressed tables (stacked, through the fused Triton
lookup), the small tables left dense inside the collection, the TT MLP layers and the
interaction run on CUDA, and each step is compared with the same step on CPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("torchrec")

from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from comera_rec.dlrm import DLRMConfig, build_dlrm_train  # noqa: E402
from comera_rec.integration import TTMEmbeddingBagCollection  # noqa: E402

CUDA = torch.device("cuda")
SIZES = [40000, 9000, 300, 12]


def _config(interaction: str) -> DLRMConfig:
    return DLRMConfig(
        table_sizes=SIZES,
        embedding_dim=8,
        dense_in_features=4,
        bottom_mlp=[64, 8],
        top_mlp=[64, 32, 1],
        rank=8,
        mlp_rank=8,
        min_rows_to_compress=1000,
        min_params_to_compress=0,
        interaction=interaction,
        dcn_num_layers=2,
        dcn_low_rank=16,
        compressed=True,
    )


def _batches(n: int, batch: int = 64) -> list[Batch]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (len(SIZES), batch), generator=g)
        values = torch.cat([torch.randint(0, s, (int(lengths[i].sum()),), generator=g) for i, s in enumerate(SIZES)])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"cat_{i}" for i in range(len(SIZES))], values=values, lengths=lengths.reshape(-1)
        )
        kjt.offsets()  # computed on CPU, so the move carries both
        dense = torch.rand(batch, 4, generator=g)
        out.append(Batch(dense, kjt, torch.randint(0, 2, (batch,), generator=g)))
    return out


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_compressed_dlrm_trains_on_cuda_as_on_cpu(interaction: str) -> None:
    torch.manual_seed(0)
    on_cpu = build_dlrm_train(_config(interaction))
    on_cuda = build_dlrm_train(_config(interaction))
    on_cuda.load_state_dict(on_cpu.state_dict())
    on_cuda = on_cuda.to(CUDA)
    collection = on_cuda.model.sparse_arch.embedding_bag_collection
    assert isinstance(collection, TTMEmbeddingBagCollection) and collection.dense_tables()
    optims = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (on_cpu, on_cuda)]
    for batch in _batches(5):
        results = []
        for model, optim, device in ((on_cpu, optims[0], "cpu"), (on_cuda, optims[1], CUDA)):
            loss, (_, logits, _) = model(batch.to(device))
            loss.backward()
            optim.step()
            optim.zero_grad()
            results.append((loss.detach().cpu(), logits.detach().cpu()))
        (loss_cpu, logits_cpu), (loss_cuda, logits_cuda) = results
        torch.testing.assert_close(loss_cuda, loss_cpu, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits_cuda, logits_cpu, rtol=1e-3, atol=1e-4)
    cuda_state = on_cuda.state_dict()
    for key, want in on_cpu.state_dict().items():
        torch.testing.assert_close(cuda_state[key].cpu(), want, rtol=1e-3, atol=1e-4, msg=key)


def _trainer_run(tmp_path, graphed: bool):
    """The DLRM trainer on CUDA, every table compressed (no dense table for FBGEMM's kernels),
    20 steps through two rank cuts, eager or as CUDA graphs."""
    from pathlib import Path

    from comera_rec.dlrm.task import DLRMTask, load_run_config
    from comera_rec.training import Trainer
    from tests.dlrm.tiny import ALL_TT, TINY, TWO_CUTS

    demo = str(Path(__file__).resolve().parents[2] / "configs/dlrm_demo.yaml")
    config = load_run_config(
        demo,
        [
            *TINY,
            *ALL_TT,
            *TWO_CUTS,
            "trainer.device=cuda",
            f"trainer.cuda_graphs={str(graphed).lower()}",
            f"trainer.run_dir={tmp_path / str(graphed)}",
        ],
    )
    trainer = Trainer(DLRMTask(config), config.trainer, config.schedule, config.optim)
    trainer.fit()
    return trainer


def test_dlrm_trainer_graphed_on_cuda_equals_eager(tmp_path) -> None:
    """The DLRM trainer's graphed loop on a real GPU: the batch checks run on the host,
    the step is captured, replayed and re-captured after each rank cut, as the eager loop
    trains (the static-shape lookups sum in another order)."""
    eager = _trainer_run(tmp_path, False)
    graphed = _trainer_run(tmp_path, True)
    assert graphed.truncations == eager.truncations >= 1
    assert len(graphed.losses) == len(eager.losses) == 20
    torch.testing.assert_close(torch.tensor(graphed.losses), torch.tensor(eager.losses), rtol=1e-3, atol=1e-4)
