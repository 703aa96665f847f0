"""Step time of compressed vs dense TorchRec DLRM on one device (the GPU check's benchmark).

``dlrm/bench.py`` measures on CPU only (its models, batches and timers are CPU ones). This
is the device-agnostic short version :mod:`comera_rec.gpu_check` runs on a CUDA machine:
Kaggle shapes, one process, the dense tables as FBGEMM table-batched kernels with row-wise
Adagrad fused into backward (``wrap_model`` without a process group; on CUDA FBGEMM's CUDA
TBE), TT tables and layers at ``--rank``, AdamW for the rest, synthetic Kaggle-shaped batches.
Prints one JSON line per variant: median step milliseconds, samples/s, peak device memory.

``--plain`` leaves FBGEMM out (for a CUDA machine without its CUDA kernels): the model is
moved to the device as one module and one AdamW updates every parameter, so the dense
tables are TorchRec's unsharded ``EmbeddingBagCollection`` with dense gradients. That is
not the FBGEMM baseline: use it for the compressed model's own step time. ``--graphed``
(with ``--plain``) runs each step as one CUDA graph (static-shape lookups, capturable AdamW,
the batch copied into static buffers, as ``trainer.cuda_graphs=true`` does).
``--sparse-tables`` (with ``--plain``, eager) gives the dense tables sparse gradients and
``torch.optim.Adagrad`` (only the rows a batch touches are updated, as FBGEMM's fused
optimiser does): the strongest dense model this script runs without FBGEMM.

    python -m comera_rec.dlrm.bench_device --device cuda            # Kaggle shapes, batch 2048
    python -m comera_rec.dlrm.bench_device --device cuda --plain    # without FBGEMM's kernels
    python -m comera_rec.dlrm.bench_device --device cuda --plain --graphed
    python -m comera_rec.dlrm.bench_device --device cuda --plain --sparse-tables
    python -m comera_rec.dlrm.bench_device --device cpu --tiny      # a smoke run (tests)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import replace

import torch

from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig
from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.model import build_dlrm_train
from comera_rec.integration.distributed import EmbeddingOptimizerSpec, replicated_parameter_groups, wrap_model
from comera_rec.tensor import set_static_shapes
from comera_rec.training.graph_capture import CudaGraphCapture, EagerCapture, GraphedTrainStep
from comera_rec.utils.logs import state_sparse_invariant_checks

TINY = dict(
    table_sizes=[5000, 200] + [30] * 24, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8, 1], min_params_to_compress=0
)


def config(variant: str, rank: int, tiny: bool) -> DLRMConfig:
    base = DLRMConfig.kaggle(**TINY) if tiny else DLRMConfig.kaggle()
    return replace(base, compressed=variant == "tt", rank=rank, mlp_rank=rank, validate_inputs=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_optimizers(model: torch.nn.Module, sparse_tables: bool, capturable: bool) -> list[torch.optim.Optimizer]:
    """AdamW over ``model``; with ``sparse_tables`` its ``nn.EmbeddingBag`` tables switched to
    sparse gradients and given ``torch.optim.Adagrad`` instead (sparse row updates)."""
    tables = []
    for m in model.modules():
        if isinstance(m, torch.nn.EmbeddingBag):
            m.sparse = sparse_tables
            tables += [m.weight] if sparse_tables else []
    table_ids = {id(t) for t in tables}
    rest = [p for p in model.parameters() if id(p) not in table_ids]
    optims: list[torch.optim.Optimizer] = [torch.optim.AdamW(rest, lr=1e-3, capturable=capturable)]
    if tables:
        state_sparse_invariant_checks()
        optims.append(torch.optim.Adagrad(tables, lr=0.05))
    return optims


def run_variant(
    variant: str,
    device: torch.device,
    batch_size: int,
    steps: int,
    warmup: int,
    rank: int,
    tiny: bool,
    plain: bool = False,
    graphed: bool = False,
    sparse_tables: bool = False,
):
    """Median step seconds of ``variant`` (``"dense"`` or ``"tt"``) over ``steps`` after ``warmup``;
    with ``plain`` the model as one module on ``device`` and AdamW over every parameter; with
    ``graphed`` (needs ``plain``) each step one CUDA graph (on CPU the eager stand-in backend);
    with ``sparse_tables`` (needs ``plain``, not ``graphed``) the dense tables' rows updated
    sparsely by Adagrad."""
    if graphed and not plain:
        raise ValueError("bench_device: graphed steps need plain=True (FBGEMM's fused optimiser is not captured)")
    if sparse_tables and (graphed or not plain):
        raise ValueError(
            "bench_device: sparse_tables needs plain=True and graphed=False (sparse updates are not captured)"
        )
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(0)
    cfg = config(variant, rank, tiny)
    if plain:
        wrapped = build_dlrm_train(cfg).to(device)
        optims = plain_optimizers(wrapped, sparse_tables, capturable=graphed and device.type == "cuda")
    else:
        model = build_dlrm_train(cfg, device="meta")
        wrapped, _ = wrap_model(
            model, device=device, embedding_optimizer=EmbeddingOptimizerSpec(RowWiseAdagrad, {"lr": 0.05, "eps": 1e-8})
        )
        optims = [torch.optim.AdamW([p for ps in replicated_parameter_groups(wrapped).values() for p in ps], lr=1e-3)]
    data = SyntheticCriteo(
        SyntheticCriteoConfig(
            num_embeddings_per_feature=list(cfg.table_sizes),
            batch_size=batch_size,
            num_rows=batch_size * (steps + warmup),
            seed=0,
            stream="train",
            drop_last=True,
        )
    )
    batches = []
    for b in itertools.islice(iter(data), steps + warmup):
        b.sparse_features.offsets()  # made on the host and moved, not made on the device by FBGEMM
        batches.append(b.to(device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def forward_backward(batch) -> torch.Tensor:
        loss, _ = wrapped(batch)
        loss.backward()
        return loss.detach()

    def update() -> None:
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=not graphed)

    def step(batch) -> torch.Tensor:
        loss = forward_backward(batch)
        update()
        return loss

    if graphed:
        set_static_shapes(wrapped)
        if device.type == "cuda":
            step = GraphedTrainStep(step, capture=CudaGraphCapture(device))
        else:
            # AdamW is capturable on CUDA only: on CPU the stand-in backend replays forward
            # and backward under the host-sync check, and the update runs after it
            checked = GraphedTrainStep(forward_backward, capture=EagerCapture(device, check_syncs=True))

            def step(batch) -> torch.Tensor:
                loss = checked(batch)
                update()
                return loss

    times = []
    for i, batch in enumerate(batches):
        _sync(device)
        start = time.perf_counter()
        loss = step(batch)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    median_step = statistics.median(times)
    return {
        "variant": variant
        + ("_plain" if plain else "")
        + ("_graphed" if graphed else "")
        + ("_sparse" if sparse_tables else ""),
        "device": str(device),
        "batch_size": batch_size,
        "steps": steps,
        "step_ms": round(median_step * 1e3, 3),
        "samples_per_s": round(batch_size / median_step),
        "peak_device_bytes": peak,
        "loss": round(float(loss.detach()), 5),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=["dense", "tt"], choices=["dense", "tt"])
    parser.add_argument("--tiny", action="store_true", help="tiny tables (a smoke run, not Kaggle shapes)")
    parser.add_argument("--plain", action="store_true", help="no FBGEMM: the model as one module, AdamW for all")
    parser.add_argument("--graphed", action="store_true", help="with --plain: each step one CUDA graph")
    parser.add_argument("--sparse-tables", action="store_true", help="with --plain: sparse table rows, Adagrad")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for variant in args.variants:
        result = run_variant(
            variant,
            device,
            args.batch_size,
            args.steps,
            args.warmup,
            args.rank,
            args.tiny,
            args.plain,
            args.graphed,
            args.sparse_tables,
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
