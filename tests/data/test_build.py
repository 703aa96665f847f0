"""build_dataloaders: the factory the trainer calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from comera_rec.data import DataConfig, build_dataloaders, num_embeddings, set_epoch

REPO = Path(__file__).resolve().parents[2]


def test_synthetic_loaders(collect_batches):
    sizes = [100] * 26
    train, val = build_dataloaders(
        DataConfig(
            batch_size=128,
            num_embeddings_per_feature=sizes,
            synthetic_train_rows=1000,
            synthetic_val_rows=300,
            rank=1,
            world_size=2,
        )
    )
    labels, dense, ids = collect_batches(train)
    assert len(labels) % 128 == 0 and len(labels) > 0 and (ids < 100).all()
    set_epoch(train, 1)
    assert len(collect_batches(val)[0]) > 0
    assert num_embeddings(DataConfig(num_embeddings_per_feature=sizes)) == sizes


def test_synthetic_loaders_with_workers(collect_batches):
    cfg = DataConfig(
        batch_size=100,
        num_embeddings_per_feature=[50] * 26,
        synthetic_train_rows=20_000,
        drop_last=False,
        num_workers=2,
    )
    train, _ = build_dataloaders(cfg)
    with_workers = collect_batches(train)
    without = collect_batches(build_dataloaders(DataConfig(**{**cfg.__dict__, "num_workers": 0}))[0])
    key = lambda t: sorted(map(tuple, t[2].tolist()))  # noqa: E731
    assert key(with_workers) == key(without)


def test_file_loaders_and_cli(sample_path, tmp_path, collect_batches):
    out = tmp_path / "pq"
    res = subprocess.run(
        [sys.executable, str(REPO / "data/preprocess_criteo.py"), str(sample_path), "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert (out / "table_sizes.json").is_file() and (out / "criteo_sample_200.parquet").is_file()
    cfg = DataConfig(
        source="parquet",
        train_paths=[str(out / "criteo_sample_200.parquet")],
        vocab_dir=str(out),
        batch_size=16,
        holdout="kaggle",
    )
    train, val = build_dataloaders(cfg)
    n_train, n_val = len(collect_batches(train)[0]), len(collect_batches(val)[0])
    assert n_train == (200 - 200 // 7) // 16 * 16 and n_val == (200 // 7 + 1) // 2
    sizes = num_embeddings(cfg)
    assert (collect_batches(train)[2] < np.array(sizes)).all()
    tsv_train, tsv_val = build_dataloaders(
        DataConfig(
            source="tsv",
            train_paths=[str(sample_path)],
            holdout="none",
            num_embeddings_per_feature=sizes,
            batch_size=50,
        )
    )
    assert tsv_val is None and len(collect_batches(tsv_train)[0]) == 200
    with pytest.raises(ValueError, match="source"):
        build_dataloaders(DataConfig(source="csv"))
