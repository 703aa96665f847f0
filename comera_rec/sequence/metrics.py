"""Ranking metrics of next-item prediction: hit rate and NDCG at k over the full catalogue.

Each evaluated sequence is one query with exactly one relevant item (its target) among
all items. Hit rate@k is 1 when the target is among the k best scores; NDCG@k is
``1 / log2(rank + 2)`` then (rank 0 = best), else 0 (the ideal DCG of one relevant item
is 1). These are torchmetrics' ``RetrievalHitRate(top_k=k)`` and
``RetrievalNormalizedDCG(top_k=k)`` with one query per row (tests/sequence compare
them), computed from the target's rank in one pass instead of a sort per query. A score
equal to the target's counts as ranked above it (pessimistic ties; torchmetrics breaks
ties by its sort's order), so a constant model scores 0, not 1.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from comera_rec.training.dist import is_distributed


def target_ranks(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(N,)`` 0-based rank of each row's target among its scores (ties pessimistic).

    Example::

        >>> target_ranks(torch.tensor([[0.1, 0.9, 0.5], [1.0, 0.0, 0.0]]), torch.tensor([2, 0])).tolist()
        [1, 0]
    """
    own = scores.gather(1, targets.long().reshape(-1, 1))
    return (scores >= own).sum(dim=1) - 1


class RankingMetrics:
    """Hit rate@k, NDCG@k, cross-entropy and mean reciprocal rank over all processes.

    Args:
        top_k: the cut-offs.
        device: where the sums live.

    Example::

        >>> m = RankingMetrics([1, 2])
        >>> m.update(torch.tensor([[0.1, 0.9, 0.5], [1.0, 0.0, 0.2]]), torch.tensor([2, 0]))
        >>> r = m.compute()
        >>> r["hit_rate_1"], r["hit_rate_2"], round(r["ndcg_2"], 4)
        (0.5, 1.0, 0.8155)
    """

    def __init__(self, top_k: Sequence[int] = (10,), device: torch.device | str = "cpu") -> None:
        self.top_k = [int(k) for k in top_k]
        self.device = torch.device(device)
        # count, cross-entropy sum, reciprocal-rank sum, then hits and DCG per k
        self.sums = torch.zeros(3 + 2 * len(self.top_k), dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def update(self, scores: torch.Tensor, targets: torch.Tensor) -> None:
        """Add a batch: ``scores (N, V)`` over all items, ``targets (N,)`` item ids."""
        targets = targets.reshape(-1).to(scores.device).long()
        if scores.dim() != 2 or scores.shape[0] != targets.numel():
            raise ValueError(
                f"RankingMetrics.update: scores {list(scores.shape)} need one row per target ({targets.numel()})"
            )
        ranks = target_ranks(scores, targets).double()
        parts = [
            torch.tensor(float(targets.numel()), dtype=torch.float64, device=scores.device),
            F.cross_entropy(scores.float(), targets, reduction="sum").double(),
            (1.0 / (ranks + 1)).sum(),
        ]
        for k in self.top_k:
            hit = ranks < k
            parts += [hit.double().sum(), torch.where(hit, 1.0 / torch.log2(ranks + 2), 0.0).sum()]
        self.sums += torch.stack(parts).to(self.device)

    def compute(self) -> dict[str, float]:
        """``hit_rate_<k>``, ``ndcg_<k>`` per k, ``mrr``, ``log_loss`` (mean cross-entropy) and
        ``count``, over every process (collective when a process group is up)."""
        sums = self.sums.clone()
        if is_distributed():
            dist.all_reduce(sums)
        count = float(sums[0])
        if count == 0:
            return {"log_loss": math.nan, "count": 0}
        out = {"log_loss": float(sums[1]) / count, "mrr": float(sums[2]) / count}
        for i, k in enumerate(self.top_k):
            out[f"hit_rate_{k}"] = float(sums[3 + 2 * i]) / count
            out[f"ndcg_{k}"] = float(sums[4 + 2 * i]) / count
        out["count"] = int(count)
        return out
