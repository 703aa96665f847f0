"""Shared fixtures for the data tests: the real Criteo sample and an independent parser."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

SAMPLE = Path(__file__).resolve().parents[2].parent / "shared/data/criteo_sample_200.tsv"


def reference_parse(path: Path, has_label: bool = True) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain-Python parse with the csv module: (labels [N], dense [N, 13], raw cat ids [N, 26])."""
    labels: List[float] = []
    dense: List[List[float]] = []
    cats: List[List[int]] = []
    with open(path, newline="") as f:
        for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            off = 1 if has_label else 0
            labels.append(float(row[0]) if has_label else -1.0)
            dense.append([math.log1p(max(int(v or 0), 0)) for v in row[off : off + 13]])
            cats.append([int(v, 16) if v else 0 for v in row[off + 13 : off + 39]])
    return np.array(labels, np.float32), np.array(dense, np.float32), np.array(cats, np.int64)


def collect(reader) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate a reader's batches into (labels [N], dense [N, 13], ids [N, 26])."""
    labels, dense, ids = [], [], []
    for b in reader:
        B = b.labels.shape[0]
        assert b.dense_features.shape == (B, 13) and b.dense_features.dtype.is_floating_point
        kjt = b.sparse_features
        assert kjt.keys() == [f"cat_{i}" for i in range(26)]
        assert bool((kjt.lengths() == 1).all())
        labels.append(b.labels.numpy())
        dense.append(b.dense_features.numpy())
        ids.append(kjt.values().numpy().reshape(26, B).T)  # feature-major -> [B, 26]
    if not labels:
        return np.zeros(0, np.float32), np.zeros((0, 13), np.float32), np.zeros((0, 26), np.int64)
    return np.concatenate(labels), np.concatenate(dense), np.concatenate(ids)


@pytest.fixture(scope="session")
def sample_path() -> Path:
    if not SAMPLE.is_file():
        pytest.skip(f"real Criteo sample not found at {SAMPLE} (shared/data is not checked out beside the repo)")
    return SAMPLE


@pytest.fixture(scope="session")
def sample_ref(sample_path: Path) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    return reference_parse(sample_path)


@pytest.fixture(scope="session")
def collect_batches():
    """The :func:`collect` helper as a fixture (works under any pytest import mode)."""
    return collect


@pytest.fixture(scope="session")
def ref_parse():
    """The :func:`reference_parse` helper as a fixture."""
    return reference_parse
