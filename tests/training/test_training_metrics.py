"""Metrics against references computed another way (numpy rank-sum AUC)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from comera_rec.training import BinaryMetrics


def rank_sum_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney U / (n_pos n_neg) with average ranks for ties."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_metrics_match_reference():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=1000)
    logits = rng.normal(size=1000) + labels * 0.8
    logits[:50] = np.round(logits[:50])  # some ties
    m = BinaryMetrics()
    for chunk in np.array_split(np.arange(1000), 7):
        m.update(torch.tensor(logits[chunk], dtype=torch.float32), torch.tensor(labels[chunk]))
    out = m.compute()
    p = 1 / (1 + np.exp(-logits))
    ref_loss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    assert out["count"] == 1000
    assert out["auc"] == pytest.approx(rank_sum_auc(logits.astype(np.float32), labels), abs=1e-5)
    assert out["accuracy"] == pytest.approx(np.mean((p > 0.5) == labels), abs=1e-6)
    assert out["log_loss"] == pytest.approx(ref_loss, rel=1e-5)
    m.reset()
    m.update(torch.tensor([3.0, -3.0]), torch.tensor([1, 0]))
    assert m.compute()["auc"] == 1.0 and m.compute()["count"] == 2


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 logits for 2 labels"):
        BinaryMetrics().update(torch.zeros(3), torch.zeros(2))
