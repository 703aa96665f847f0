"""Engine tasks for the transformer backbones, their metrics, and the phase-2 rank cut.

:class:`ClassificationTask` (sentence pairs) and :class:`MaskedLMTask` (code) are
engine tasks (subclasses of :class:`comera_rec.training.Task`) for every method of
:mod:`comera_rec.transformer.baselines`. The engine's own validation reports binary
metrics; :class:`TransformerTrainer` is the engine with one change: it validates with the
task's :meth:`metrics` (accuracy, cross-entropy and perplexity).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from comera_rec.tensor import tensor_train_modules
from comera_rec.training import Task, Trainer
from comera_rec.training.dist import is_distributed, shard, unwrap_data_parallel
from comera_rec.transformer import baselines
from comera_rec.transformer.baselines import MethodConfig
from comera_rec.transformer.config import EncoderConfig
from comera_rec.transformer.data import PairDataset, mask_tokens
from comera_rec.transformer.model import MaskedLM, SequenceClassifier

IGNORE = -100


class TokenMetrics:
    """Accuracy, mean cross-entropy and perplexity of class logits, over all processes.

    Labels equal to -100 are ignored, and ``labels`` may have more dimensions than the
    logits' rows (masked-LM: ``(B, L)`` labels, one logit row per label that is not -100,
    in row-major order).

    Example::

        >>> m = TokenMetrics()
        >>> m.update(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
        >>> m.compute()["accuracy"]
        0.5
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, correct, count

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``logits (N, C)``, labels with N entries that are not -100."""
        labels = labels.reshape(-1).to(logits.device)
        labels = labels[labels != IGNORE]
        if labels.numel() != logits.shape[0]:
            raise ValueError(f"TokenMetrics.update: {logits.shape[0]} logit rows for {labels.numel()} labels")
        loss = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(dim=-1) == labels).sum()
        count = torch.tensor(float(labels.numel()), dtype=torch.float64, device=logits.device)
        self.sums += torch.stack([loss.double(), correct.double(), count]).to(self.device)

    def compute(self) -> dict[str, float]:
        """``{"accuracy", "log_loss", "perplexity", "count"}`` over every process (collective)."""
        sums = self.sums.clone()
        if is_distributed():
            dist.all_reduce(sums)
        loss, correct, count = (float(x) for x in sums)
        if count == 0:
            return {"accuracy": math.nan, "log_loss": math.nan, "perplexity": math.nan, "count": 0}
        mean = loss / count
        return {
            "accuracy": correct / count,
            "log_loss": mean,
            "perplexity": math.exp(min(mean, 700.0)),
            "count": int(count),
        }


class TransformerTrainer(Trainer):
    """The training engine, unchanged: it validates with the task's ``metrics(device)``.

    ``last_eval`` then holds accuracy, log_loss (mean cross-entropy) and perplexity; the
    plateau switch of the rank schedule watches log_loss as usual.
    """


class _EncoderTask(Task):
    """Shared part of the tasks: building the method's model, wrapping, optimisers."""

    model_class: type[nn.Module] = SequenceClassifier

    def __init__(self, model_config: EncoderConfig, method: MethodConfig, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_config = model_config.replace(compressed=method.compressed)
        self.method = method
        self.batch_size = batch_size
        self.seed = seed
        self.device = torch.device("cpu")

    def build_model(self, device: torch.device) -> nn.Module:
        self.device = torch.device(device)
        model = self.model_class(self.model_config)
        return baselines.prepare_model(model, self.method).to(self.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        if shard()[1] > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def optimizer_parameters(self, wrapped: nn.Module) -> list[nn.Parameter]:
        """What the method's engine optimiser updates (GaLore / LTE bring their own for the rest)."""
        return baselines.engine_parameters(unwrap_data_parallel(wrapped), self.method)

    def extra_optimizers(self, wrapped: nn.Module) -> list[Any]:
        """The method's own optimisers (GaLore, LTE), if any."""
        return baselines.extra_optimizers(unwrap_data_parallel(wrapped), self.method)

    def metrics(self, device: torch.device) -> TokenMetrics:
        """Accuracy, cross-entropy and perplexity instead of the default binary metrics."""
        return TokenMetrics(device)


class ClassificationTask(_EncoderTask):
    """Sentence-pair classification: cross-entropy over ``num_labels`` classes.

    Args:
        model_config: the encoder (``compressed`` is set from the method).
        method: compressed, dense, GaLore or LTE.
        train: training pairs.
        val: validation pairs.
        batch_size: training rows per process and step.
        eval_batch_size: validation rows per batch.
        seed: shuffling seed (epoch e uses seed + e).
        fixed_width: training batches keep the full padded width (one shape for every
            step, which CUDA-graph capture needs); trimmed to their longest row otherwise.

    Example::

        >>> task = ClassificationTask(cfg, MethodConfig("dense"), train, val, batch_size=32)  # doctest: +SKIP
        >>> TransformerTrainer(task, TrainerConfig(max_steps=100)).fit()  # doctest: +SKIP
    """

    model_class = SequenceClassifier

    def __init__(
        self,
        model_config: EncoderConfig,
        method: MethodConfig,
        train: PairDataset,
        val: PairDataset,
        batch_size: int,
        eval_batch_size: int = 256,
        seed: int = 0,
        fixed_width: bool = False,
    ) -> None:
        super().__init__(model_config, method, batch_size, seed)
        self.train, self.val = train, val
        self.eval_batch_size = eval_batch_size
        self.fixed_width = fixed_width

    def train_batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        return self.train.batches(
            self.batch_size,
            shuffle=True,
            seed=self.seed + epoch,
            shard=shard(),
            drop_last=True,
            fixed_width=self.fixed_width,
        )

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.val.batches(self.eval_batch_size, shuffle=False, shard=shard())

    def step_loss(self, wrapped: nn.Module, batch: dict[str, torch.Tensor]):
        b = {k: v.to(self.device) for k, v in batch.items()}
        logits = wrapped(b["ids"], b["mask"], b["segments"])  # (B, num_labels)
        return F.cross_entropy(logits, b["labels"]), logits, b["labels"]


class MaskedLMTask(_EncoderTask):
    """RoBERTa-style masked-LM on packed blocks; masks are drawn per (epoch, batch).

    Args:
        model_config: the encoder (``compressed`` is set from the method).
        method: compressed, dense, GaLore or LTE.
        train_blocks: ``(N, L)`` token blocks.
        val_blocks: ``(N_val, L)`` token blocks (masked the same way at every evaluation).
        batch_size: training blocks per process and step.
        mask_id: id of ``<mask>``.
        special_ids: ids never masked.
        mask_prob: fraction of tokens predicted.
        eval_batch_size: validation blocks per batch.
        seed: shuffling and masking seed.
        init_state: optional model state dict to start from (phase 2).
        rank_fraction: with ``init_state``, keep this fraction of each bond's rank (phase 2).
        cut_threshold: with ``init_state``, also cut ranks whose |D| is below this (phase 2).
    """

    model_class = MaskedLM

    def __init__(
        self,
        model_config: EncoderConfig,
        method: MethodConfig,
        train_blocks: torch.Tensor,
        val_blocks: torch.Tensor,
        batch_size: int,
        *,
        mask_id: int,
        special_ids: Sequence[int],
        mask_prob: float = 0.15,
        eval_batch_size: int = 64,
        seed: int = 0,
        init_state: Optional[dict[str, torch.Tensor]] = None,
        rank_fraction: float = 1.0,
        cut_threshold: float = 0.0,
    ) -> None:
        super().__init__(model_config, method, batch_size, seed)
        if len(train_blocks) == 0 or len(val_blocks) == 0:
            raise ValueError(
                f"MaskedLMTask: need training and validation blocks, got {len(train_blocks)} and {len(val_blocks)}"
            )
        self.train_blocks, self.val_blocks = train_blocks, val_blocks
        self.eval_batch_size = eval_batch_size
        self.mask_kw = dict(
            mask_id=mask_id, vocab_size=model_config.vocab_size, special_ids=list(special_ids), prob=mask_prob
        )
        self.init_state = init_state
        self.rank_fraction = rank_fraction
        self.cut_threshold = cut_threshold

    def build_model(self, device: torch.device) -> nn.Module:
        model = super().build_model(device)
        if self.init_state is not None:
            from comera_rec.rank import resize_to_state_dict

            resize_to_state_dict(model, self.init_state)
            model.load_state_dict(self.init_state)
            shrink_ranks(model, self.rank_fraction, self.cut_threshold)
        return model

    def _blocks(self, blocks: torch.Tensor, batch: int, order: torch.Tensor, seed: int):
        rank, world = shard()
        order = order[: len(order) - len(order) % world][rank::world]
        for i, start in enumerate(range(0, len(order) - batch + 1 if len(order) >= batch else 1, batch)):
            ids = blocks[order[start : start + batch]]
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            inputs, labels = mask_tokens(ids, gen, **self.mask_kw)
            yield {"inputs": inputs, "labels": labels}

    def train_batches(self, epoch: int):
        order = torch.randperm(len(self.train_blocks), generator=torch.Generator().manual_seed(self.seed + epoch))
        return self._blocks(self.train_blocks, self.batch_size, order, self.seed + 7919 * (epoch + 1))

    def val_batches(self):
        return self._blocks(
            self.val_blocks, min(self.eval_batch_size, len(self.val_blocks)), torch.arange(len(self.val_blocks)), 12345
        )

    def step_loss(self, wrapped: nn.Module, batch: dict[str, torch.Tensor]):
        inputs, labels = batch["inputs"].to(self.device), batch["labels"].to(self.device)
        picked = labels != IGNORE  # (B, L)
        logits = wrapped(inputs, None, picked)  # (M, V)
        return F.cross_entropy(logits, labels[picked]), logits, labels


@torch.no_grad()
def shrink_ranks(model: nn.Module, fraction: float = 1.0, threshold: float = 0.0) -> bool:
    """Compress further: keep the largest ``fraction`` of each bond's rank controllers.

    On every bond of every TT module the entries of ``|D|`` below ``threshold``, and all
    but the ``ceil(fraction * r)`` largest, are zeroed and then cut for real with
    ``truncate_ranks`` (at least one slice survives per bond).

    Args:
        model: the model; its TT modules are changed in place (new parameters).
        fraction: share of each bond's rank kept, in (0, 1].
        threshold: also cut entries with ``|D|`` below it.

    Returns:
        True if any rank fell (rebuild optimisers afterwards).

    Example::

        >>> from comera_rec.tensor import TTLinear
        >>> m = nn.Sequential(TTLinear(64, 64, rank=8))
        >>> shrink_ranks(m, fraction=0.5), m[0].ranks
        (True, [4, 4, 4])
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"shrink_ranks: fraction must be in (0, 1], got {fraction}")
    changed = False
    for _, module in tensor_train_modules(model):
        for d in module.controllers:
            mags = d.detach().abs()
            flat = mags.reshape(-1, mags.shape[-1]).amax(dim=0)  # (r,): stacked trains keep a slice any train needs
            keep = max(1, math.ceil(fraction * flat.numel()))
            dead = flat < threshold
            if keep < flat.numel():
                dead[flat.argsort(descending=True)[keep:]] = True
            if bool(dead.all()):
                dead[flat.argmax()] = False
            d[..., dead] = 0.0
        changed |= module.truncate_ranks(threshold=1e-30)
    return changed
