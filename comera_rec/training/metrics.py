"""Binary classification metrics over all processes: AUC, accuracy, log loss.

AUC and accuracy come from torchmetrics (their states are gathered across processes on
``compute()`` when a process group is initialised, gloo or nccl); the log loss is a
sum and a count all-reduced here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

from comera_rec.training.dist import is_distributed


class BinaryMetrics:
    """AUC, accuracy (positive when the probability is > 0.5) and log loss of logits.

    Args:
        device: where the metric states live (the device of the logits).

    Example::

        >>> m = BinaryMetrics()
        >>> m.update(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1, 0, 0]))
        >>> sorted(m.compute())
        ['accuracy', 'auc', 'count', 'log_loss']
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.auroc = BinaryAUROC().to(self.device)
        self.accuracy = BinaryAccuracy().to(self.device)
        self.reset()

    def reset(self) -> None:
        """Forget every update."""
        self.auroc.reset()
        self.accuracy.reset()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._count = torch.zeros((), dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch.

        Args:
            logits: ``(B,)`` (or ``(B, 1)``) raw scores.
            labels: ``(B,)`` labels in {0, 1}.
        """
        logits = logits.detach().reshape(-1).float().to(self.device)
        labels = labels.detach().reshape(-1).to(self.device)
        if logits.shape != labels.shape:
            raise ValueError(f"BinaryMetrics.update: {logits.numel()} logits for {labels.numel()} labels")
        probs = torch.sigmoid(logits)
        self.auroc.update(probs, labels.long())
        self.accuracy.update(probs, labels.long())
        self._loss_sum += F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum").double()
        self._count += labels.numel()

    def compute(self) -> dict[str, float]:
        """The metrics over every update of every process.

        Every process must call it (it runs collectives when distributed).

        Returns:
            ``{"auc", "accuracy", "log_loss", "count"}``.
        """
        sums = torch.stack([self._loss_sum, self._count])
        if is_distributed():
            dist.all_reduce(sums)
        count = float(sums[1])
        auc = float(self.auroc.compute()) if count > 0 else float("nan")
        acc = float(self.accuracy.compute()) if count > 0 else float("nan")
        return {
            "auc": auc,
            "accuracy": acc,
            "log_loss": float(sums[0]) / count if count > 0 else float("nan"),
            "count": int(count),
        }
