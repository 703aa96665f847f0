"""A tiny task for engine tests: a TTLinear + TTMEmbeddingBag click model on synthetic data."""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from comera_rec.tensor import TTLinear, TTMEmbeddingBag

NUM_IDS = 64
DENSE = 16


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = TTLinear(DENSE, 8, rank=4)
        self.emb = TTMEmbeddingBag(NUM_IDS, 8, rank=4)
        self.head = nn.Linear(16, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.lin(dense), self.emb(ids, offsets)], dim=1)
        return self.head(torch.relu(h)).squeeze(-1)


def make_batch(gen: torch.Generator, batch: int) -> dict[str, torch.Tensor]:
    dense = torch.randn(batch, DENSE, generator=gen)
    ids = torch.randint(0, NUM_IDS, (batch * 2,), generator=gen)
    offsets = torch.arange(0, batch * 2 + 1, 2)
    # a learnable rule: the sign of a fixed projection of the dense features plus an id effect
    w = torch.linspace(-1, 1, DENSE)
    score = dense @ w + ((ids[0::2] % 2) * 2 - 1).float()
    labels = (score + 0.3 * torch.randn(batch, generator=gen) > 0).float()
    return {"dense": dense, "ids": ids, "offsets": offsets, "labels": labels}


class ToyTask:
    """Deterministic data per (epoch, rank); NaN loss on the batches listed in nan_batches."""

    def __init__(
        self, batches_per_epoch: int = 5, batch: int = 32, val_batches: int = 4, nan_batches: tuple[int, ...] = ()
    ) -> None:
        self.batches_per_epoch = batches_per_epoch
        self.batch = batch
        self.num_val = val_batches
        self.nan_batches = set(nan_batches)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.seen = 0

    def build_model(self, device: torch.device) -> nn.Module:
        return ToyModel().to(device)

    def wrap(self, model: nn.Module) -> nn.Module:
        if dist.is_initialized() and dist.get_world_size() > 1:
            return nn.parallel.DistributedDataParallel(model)
        return model

    def train_batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        gen = torch.Generator().manual_seed(1000 + 97 * epoch + self.rank)
        for i in range(self.batches_per_epoch):
            b = make_batch(gen, self.batch)
            b["index"] = torch.tensor(epoch * self.batches_per_epoch + i)
            yield b

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        gen = torch.Generator().manual_seed(5 + rank)
        for _ in range(self.num_val):
            yield make_batch(gen, 64)

    def step_loss(self, wrapped: nn.Module, batch: dict[str, torch.Tensor]):
        logits = wrapped(batch["dense"], batch["ids"], batch["offsets"])
        loss = F.binary_cross_entropy_with_logits(logits, batch["labels"])
        if "index" in batch and int(batch["index"]) in self.nan_batches and wrapped.training:
            loss = loss * math.nan
        return loss, logits, batch["labels"]
