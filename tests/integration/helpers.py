"""Small tables and KJTs shared by the integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.integration import CompressionPolicy, TableOverride, TTMEmbeddingBagCollection

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ((10, 10), (2, 4))  # rows <= 100, dim 8

# TorchRec's stock DMP call, as its examples write it, warns about its own defaults (the
# planner's storage reservation, broadcast_buffers); the small dense tables its planner puts
# on data_parallel get FBGEMM's dense CPU lookup, which has no autograd kernel (the known CPU
# limit, docs/torchrec.md); DDP notes the strides of (r, n, 1) cores. None is what is tested.
STOCK_DMP_WARNINGS = [
    pytest.mark.filterwarnings("ignore:HeuristicalStorageReservation is known to cause issues:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Grad strides do not match bucket view strides:UserWarning"),
    pytest.mark.filterwarnings("ignore:fbgemm..dense_embedding_codegen_lookup_function:UserWarning"),
]


def tables(pooling: PoolingType = PoolingType.SUM) -> list[EmbeddingBagConfig]:
    """Two stackable TTM tables (one read by two features), a third TTM table of another
    shape, and a small dense table that shares feature f0."""
    return [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f0", "f1"], pooling=pooling),
        EmbeddingBagConfig(
            name="b", embedding_dim=8, num_embeddings=90, feature_names=["f2"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=10, feature_names=["f0"], pooling=pooling),
        EmbeddingBagConfig(name="d", embedding_dim=8, num_embeddings=300, feature_names=["f3"], pooling=pooling),
    ]


def policy(rank: int = 4) -> CompressionPolicy:
    return CompressionPolicy(
        rank=rank,
        min_rows_to_compress=50,
        min_params_to_compress=0,
        min_gain=0.0,
        per_table={"a": TableOverride(shape=SHAPE), "b": TableOverride(shape=SHAPE)},
    )


def kjt(weighted: bool = False, batch: int = 3, seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    bounds = {"f0": 10, "f1": 100, "f2": 90, "f3": 300}
    lengths = torch.randint(0, 4, (len(bounds), batch), generator=g)
    lengths[0, 0] = 0  # an empty bag
    values = torch.cat(
        [torch.randint(0, n, (int(lengths[i].sum()),), generator=g) for i, n in enumerate(bounds.values())]
    )
    weights = torch.rand(values.shape, generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(bounds), values=values, lengths=lengths.reshape(-1), weights=weights
    )


def reference_ebc(
    ttm: TTMEmbeddingBagCollection, configs: list[EmbeddingBagConfig], weighted: bool = False
) -> EmbeddingBagCollection:
    """TorchRec's EBC loaded with the dense reconstruction of ``ttm``."""
    ref = EmbeddingBagCollection(configs, is_weighted=weighted)
    with torch.no_grad():
        for name, bag in ref.embedding_bags.items():
            bag.weight.copy_(ttm.table_weight(name))
    return ref


def run_two_process_worker(worker: str, tmp: Path, timeout: int, **env: str) -> Path:
    """Run ``tests/integration/<worker>`` under torchrun with 2 processes (gloo, one thread
    each; torchelastic's files under ``tmp``) and return the folder it wrote its results to.

    Args:
        worker: the worker script's file name.
        tmp: a test's temporary folder.
        timeout: seconds before the launch fails.
        env: extra environment variables for the worker.
    """
    out = tmp / "out"
    out.mkdir()
    environ = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    script = ROOT / "tests" / "integration" / worker
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        str(script),
        str(out),
    ]
    proc = subprocess.run(command, env=environ, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
