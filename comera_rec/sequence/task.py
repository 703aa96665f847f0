"""The masked-item model as an engine task, the run driver and the command line.

:class:`MaskedItemTask` is an engine task (a :class:`comera_rec.training.Task`): cloze
batches for training, one masked last position per user for validation, and ranking
metrics (:class:`RankingMetrics`) instead of the engine's binary ones. :func:`run_seq`
loads the data, trains with the engine, tests on the leave-one-out test items and adds
the reference figures (random ranking and, for the synthetic chain, the best achievable)
to the summary.

    python launch/train_seq.py --config configs/seq_synthetic.yaml
    python launch/train_seq.py --config configs/seq_synthetic.yaml model.compressed=false
    python launch/train_seq.py --config configs/seq_movielens.yaml data.source=/data/ml-1m/ratings.dat

``--config`` takes a path or a shipped config's name; ``--help-config`` prints the
resolved config. Fields: docs/sequence.md (model, data) and docs/training.md (trainer,
schedule, optim).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from comera_rec.config import run_config_from_args
from comera_rec.rank import RankScheduleConfig
from comera_rec.sequence.config import SeqDataConfig, SeqModelConfig, SeqRunConfig
from comera_rec.sequence.data import (
    MarkovChain,
    Sequences,
    SequenceSplits,
    evaluation_batches,
    leave_one_out,
    markov_sessions,
    read_interactions,
    training_batches,
)
from comera_rec.sequence.metrics import RankingMetrics
from comera_rec.sequence.model import MaskedItemModel, item_kjt
from comera_rec.training import Task, Trainer
from comera_rec.training.dist import shard
from comera_rec.utils.logs import setup_logging


class MaskedItemTask(Task):
    """The engine's view of a masked-item run.

    Args:
        model: the model config.
        data: masking, batch sizes and metric cut-offs.
        splits: the leave-one-out sequences.
        seed: shuffling and masking seed (epoch e uses seed + e).

    Example::

        >>> seqs, chain = markov_sessions(500, 50, seed=0)
        >>> task = MaskedItemTask(SeqModelConfig(compressed=False), SeqDataConfig(), leave_one_out(seqs, 50))
        >>> Trainer(task, TrainerConfig(run_dir="runs/seq", max_steps=20)).fit()  # doctest: +SKIP
    """

    def __init__(self, model: SeqModelConfig, data: SeqDataConfig, splits: SequenceSplits, seed: int = 0) -> None:
        if len(splits.train) < data.batch_size:
            raise ValueError(
                f"MaskedItemTask: {len(splits.train)} training sequences, fewer than data.batch_size={data.batch_size}"
            )
        self.model_config = model
        self.data = data
        self.splits = splits
        self.seed = seed
        self.device = torch.device("cpu")

    @property
    def mask_id(self) -> int:
        return self.splits.num_items

    def build_model(self, device: torch.device) -> nn.Module:
        self.device = torch.device(device)
        return MaskedItemModel(self.model_config, self.splits.num_items, device=self.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        if shard()[1] > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model

    def train_batches(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        d = self.data
        return training_batches(
            self.splits.train,
            d.batch_size,
            self.model_config.max_len,
            self.mask_id,
            mask_prob=d.mask_prob,
            mask_last_prob=d.mask_last_prob,
            seed=self.seed * 1_000_003 + epoch,
            shard=shard(),
        )

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.eval_batches(self.splits.val)

    def eval_batches(self, seqs: Sequences) -> Iterator[dict[str, torch.Tensor]]:
        """Batches predicting each target of ``seqs`` (the validation or test split)."""
        return evaluation_batches(seqs, self.data.eval_batch_size, self.model_config.max_len, self.mask_id, shard())

    def step_loss(
        self, wrapped: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mean cross-entropy over the picked positions, scores (M, V), labels (M,))``."""
        b = {k: v.to(self.device) for k, v in batch.items()}
        scores = wrapped(item_kjt(b["values"], b["lengths"]), b["picked"])
        return F.cross_entropy(scores, b["labels"]), scores, b["labels"]

    def metrics(self, device: torch.device) -> RankingMetrics:
        """Hit rate and NDCG at ``data.top_k`` (the engine validates with these)."""
        return RankingMetrics(self.data.top_k, device)

    @torch.no_grad()
    def evaluate(self, wrapped: nn.Module, seqs: Sequences) -> dict[str, float]:
        """The ranking metrics of ``seqs``' targets (collective under a process group)."""
        metrics = self.metrics(self.device)
        was_training = wrapped.training
        wrapped.eval()
        try:
            for batch in self.eval_batches(seqs):
                _, scores, labels = self.step_loss(wrapped, batch)
                metrics.update(scores, labels)
        finally:
            wrapped.train(was_training)
        return metrics.compute()

    def checkpoint_config_keys(self) -> list[str]:
        """A resumed run must keep the model section."""
        return ["model."]


def load_splits(data: SeqDataConfig) -> tuple[SequenceSplits, Optional[MarkovChain]]:
    """The leave-one-out splits of ``data``, and the synthetic chain (``None`` for a file)."""
    if data.source == "synthetic":
        seqs, chain = markov_sessions(
            data.num_users,
            data.num_items,
            min_length=data.min_length,
            max_length=data.max_length,
            branching=data.branching,
            noise=data.noise,
            clusters=data.clusters,
            seed=data.generator_seed,
        )
        return leave_one_out(seqs, data.num_items), chain
    read = read_interactions(
        data.source,
        fmt=data.format,
        separator=data.separator,
        header=data.header,
        columns=data.columns,
        user_column=data.user_column,
        item_column=data.item_column,
        time_column=data.time_column,
        min_sequence_length=data.min_sequence_length,
        max_users=data.max_users,
    )
    return leave_one_out(read.sequences, len(read.item_ids), read.item_ids), None


def reference_figures(top_k: Sequence[int], num_items: int, chain: Optional[MarkovChain]) -> dict[str, float]:
    """Hit rate / NDCG of a random ranking (``random_hit_rate_<k>`` = k / V) and, with a
    chain, the best achievable (``best_hit_rate_<k>``, ``best_ndcg_<k>``).

    Example::

        >>> reference_figures([10], 1000, None)
        {'random_hit_rate_10': 0.01}
    """
    out: dict[str, float] = {}
    for k in top_k:
        out[f"random_hit_rate_{k}"] = min(k, num_items) / num_items
        if chain is not None:
            out[f"best_hit_rate_{k}"] = chain.best_hit_rate(k)
            out[f"best_ndcg_{k}"] = chain.best_ndcg(k)
    return out


def _schedule_for(cfg: SeqRunConfig) -> RankScheduleConfig:
    # a dense item table has no ranks to adapt
    return cfg.schedule if cfg.model.compressed else dataclasses.replace(cfg.schedule, enabled=False, truncate_every=0)


def run_seq(cfg: SeqRunConfig) -> dict[str, Any]:
    """Train the masked-item model with the engine, then test it.

    Returns:
        The engine's summary (validation metrics ``val_hit_rate_<k>``, ``val_ndcg_<k>``,
        sizes) plus ``test_*`` metrics, the reference figures (:func:`reference_figures`),
        ``num_items``, ``num_users``, ``item_table_bytes`` and ``compressed``; also merged
        into ``run_dir/summary.json``.

    Example::

        >>> from comera_rec.config import load_config
        >>> run_seq(load_config(SeqRunConfig, "configs/seq_synthetic.yaml", ["trainer.max_steps=5"]))  # doctest: +SKIP
    """
    splits, chain = load_splits(cfg.data)
    task = MaskedItemTask(cfg.model, cfg.data, splits, seed=cfg.trainer.seed)
    trainer = Trainer(task, cfg.trainer, _schedule_for(cfg), cfg.optim, cfg)
    summary = trainer.fit()
    # the engine has closed its wrapper and any process group it made: each process tests
    # the whole test split with the unwrapped model (no collective left to share it)
    model = trainer.model
    test = task.evaluate(model, splits.test)
    summary = {
        **summary,
        **{f"test_{k}": v for k, v in test.items() if k != "count"},
        **reference_figures(cfg.data.top_k, splits.num_items, chain),
        "num_items": splits.num_items,
        "num_users": len(splits.train),
        "item_table_bytes": sum(p.numel() * p.element_size() for p in model.items.parameters()),
        "compressed": cfg.model.compressed,
    }
    path = Path(cfg.trainer.run_dir) / "summary.json"
    if trainer.process_rank == 0 and path.exists():  # the engine's file: rank 0's alone
        path.write_text(json.dumps({**json.loads(path.read_text()), **summary}, indent=1, default=str))
    return summary


def train(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Parse ``argv`` (``None``: ``sys.argv[1:]``), train, print one line per metric cut-off
    and return the summary (``{}`` after ``--help-config``). ``launch/train_seq.py`` runs this."""
    setup_logging()
    config = run_config_from_args(
        SeqRunConfig,
        argv,
        __doc__,
        config_help="YAML run config: a path, or a shipped config's name (seq_synthetic, seq_movielens)",
        overrides_help="section.key=value, e.g. model.compressed=false trainer.max_steps=200",
    )
    if config is None:  # --help-config
        return {}
    s = run_seq(config)
    kind = "TT" if config.model.compressed else "dense"
    for k in config.data.top_k:
        best = f", best {s[f'best_hit_rate_{k}']:.4f} / {s[f'best_ndcg_{k}']:.4f}" if f"best_hit_rate_{k}" in s else ""
        print(
            f"{kind} @{k}: test hit rate {s[f'test_hit_rate_{k}']:.4f}, NDCG {s[f'test_ndcg_{k}']:.4f} "
            f"(random {s[f'random_hit_rate_{k}']:.4f}{best})"
        )
    print(f"{kind}: item table {s['item_table_bytes']:,} bytes, {s['num_items']:,} items, {s['num_users']:,} users")
    return s


def main(argv: Optional[Sequence[str]] = None) -> int:
    """:func:`train`, exit status 0."""
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
