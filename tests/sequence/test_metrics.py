"""RankingMetrics against torchmetrics' RetrievalHitRate and RetrievalNormalizedDCG (one
query per row, one relevant item), and across batches."""

from __future__ import annotations

import pytest
import torch
from torchmetrics.retrieval import RetrievalHitRate, RetrievalMRR, RetrievalNormalizedDCG

from comera_rec.sequence.metrics import RankingMetrics, target_ranks


def torchmetrics_reference(scores: torch.Tensor, targets: torch.Tensor, k: int) -> dict[str, float]:
    n, v = scores.shape
    relevant = torch.zeros(n, v, dtype=torch.bool)
    relevant[torch.arange(n), targets] = True
    indexes = torch.arange(n).unsqueeze(1).expand(n, v).flatten()
    args = (scores.flatten(), relevant.flatten(), indexes)
    return {
        f"hit_rate_{k}": float(RetrievalHitRate(top_k=k)(*args)),
        f"ndcg_{k}": float(RetrievalNormalizedDCG(top_k=k)(*args)),
        "mrr": float(RetrievalMRR()(*args)),
    }


@pytest.mark.parametrize("k", [1, 5, 20])
def test_matches_torchmetrics(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(300, 40, generator=g)
    targets = torch.randint(0, 40, (300,), generator=g)
    scores[:50, :] -= 10.0  # some easy rows: target put on top
    scores[torch.arange(50), targets[:50]] += 30.0
    metrics = RankingMetrics([k])
    for part in range(3):  # three batches accumulate to the one-shot figures
        metrics.update(scores[part * 100 : (part + 1) * 100], targets[part * 100 : (part + 1) * 100])
    mine = metrics.compute()
    for key, value in torchmetrics_reference(scores, targets, k).items():
        assert mine[key] == pytest.approx(value, abs=1e-6), key
    assert mine["count"] == 300
    assert mine["log_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(scores, targets)), rel=1e-6)


def test_ties_are_pessimistic() -> None:
    """A constant model ranks every target last among equals: hit rate 0, not 1."""
    ranks = target_ranks(torch.zeros(3, 10), torch.tensor([0, 4, 9]))
    assert ranks.tolist() == [9, 9, 9]
    m = RankingMetrics([5])
    m.update(torch.zeros(3, 10), torch.tensor([0, 4, 9]))
    assert m.compute()["hit_rate_5"] == 0.0


def test_shape_error() -> None:
    with pytest.raises(ValueError, match="one row per target"):
        RankingMetrics([1]).update(torch.zeros(3, 10), torch.tensor([1, 2]))
