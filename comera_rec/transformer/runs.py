"""Run configurations and drivers: a config (YAML + overrides) in, a trained model and a
summary out. The entry points in ``launch/`` only parse the command line and call
:func:`run_classification` or :func:`run_masked_lm`.

Example::

    >>> cfg = load_config(ClassificationRun, "configs/transformer_tiny.yaml", ["trainer.max_steps=5"])  # doctest: +SKIP
    >>> summary = run_classification(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from comera_rec.rank import RankScheduleConfig
from comera_rec.training import OptimConfig, TrainerConfig, latest_checkpoint, load_checkpoint
from comera_rec.transformer.baselines import MethodConfig
from comera_rec.transformer.config import EncoderConfig
from comera_rec.transformer.data import (
    PairDataset,
    PairExamples,
    pack_blocks,
    read_code_corpus,
    read_nli_tsv,
    synthetic_nli,
)
from comera_rec.transformer.tasks import ClassificationTask, MaskedLMTask, TransformerTrainer
from comera_rec.transformer.tokenizer import (
    load_tokenizer,
    load_wordpiece,
    save_tokenizer,
    special_id,
    train_code_bpe,
    train_wordpiece,
)

# ----------------------------------------------------------------------------- sentence pairs


@dataclass
class PairDataConfig:
    """Where sentence pairs come from and how they are tokenised and batched."""

    source: str = "synthetic"
    """"synthetic" (offline three-label task) or a folder holding MNLI-style TSV files."""
    train_file: str = "train.tsv"
    """Training TSV inside `source` (columns sentence1, sentence2, gold_label)."""
    val_file: str = "dev_matched.tsv"
    """Validation TSV inside `source`."""
    max_train: Optional[int] = None
    """Use at most this many training pairs (None: all)."""
    max_val: Optional[int] = None
    """Use at most this many validation pairs (None: all)."""
    synthetic_train: int = 20000
    """Synthetic task: training pairs."""
    synthetic_val: int = 2000
    """Synthetic task: validation pairs."""
    synthetic_words: int = 24
    """Synthetic task: size of its made-up vocabulary."""
    vocab_file: Optional[str] = None
    """A BERT vocab.txt to load; None trains a WordPiece tokenizer on the training pairs."""
    tokenizer_vocab_size: int = 8000
    """Largest vocabulary of a locally trained WordPiece tokenizer."""
    lowercase: bool = True
    """Lowercase before tokenising (BERT uncased)."""
    max_len: int = 128
    """Tokens per pair ([CLS] a [SEP] b [SEP]), truncated longest-first."""
    batch_size: int = 32
    """Training pairs per process and step."""
    eval_batch_size: int = 256
    """Validation pairs per batch."""


@dataclass
class ClassificationRun:
    """A sentence-pair classification run: model, data, method and the engine's settings."""

    model: EncoderConfig = field(default_factory=EncoderConfig)
    """The encoder (vocab_size is set from the tokenizer)."""
    data: PairDataConfig = field(default_factory=PairDataConfig)
    """The sentence pairs."""
    method: MethodConfig = field(default_factory=MethodConfig)
    """compressed, dense, galore or lte."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The engine's loop settings."""
    schedule: RankScheduleConfig = field(default_factory=RankScheduleConfig)
    """The rank-adaptive objective (turned off for the uncompressed methods)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The engine's optimiser (learning rates of cores, controllers and the rest)."""


def load_pairs(data: PairDataConfig) -> tuple[PairExamples, PairExamples]:
    """The training and validation pairs of ``data``."""
    if data.source == "synthetic":
        train = synthetic_nli(data.synthetic_train, seed=1, num_words=data.synthetic_words)
        val = synthetic_nli(data.synthetic_val, seed=2, num_words=data.synthetic_words)
        return train, val
    root = Path(data.source)
    train = read_nli_tsv(root / data.train_file, data.max_train)
    val = read_nli_tsv(root / data.val_file, data.max_val)
    return train, val


def build_pair_datasets(data: PairDataConfig, run_dir: Optional[Path] = None):
    """Tokenizer and encoded datasets; the tokenizer is saved into ``run_dir`` when given.

    Returns:
        ``(tokenizer, train PairDataset, val PairDataset)``.
    """
    train, val = load_pairs(data)
    if data.vocab_file:
        tok = load_wordpiece(data.vocab_file, lowercase=data.lowercase)
    else:
        tok = train_wordpiece(
            (s for pair in zip(train.firsts, train.seconds) for s in pair),
            data.tokenizer_vocab_size,
            lowercase=data.lowercase,
        )
    if run_dir is not None:
        save_tokenizer(tok, run_dir)
    return tok, PairDataset.from_examples(tok, train, data.max_len), PairDataset.from_examples(tok, val, data.max_len)


def _schedule_for(method: MethodConfig, schedule: RankScheduleConfig) -> RankScheduleConfig:
    return schedule if method.compressed else dataclasses.replace(schedule, enabled=False, truncate_every=0)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def run_classification(cfg: ClassificationRun) -> dict[str, Any]:
    """Train (and validate) a sentence-pair classifier with the engine.

    Returns:
        The engine's summary, with ``val_accuracy``, ``val_log_loss``, the parameter count
        and the method's name added; also written to ``run_dir/summary.json``.
    """
    run_dir = Path(cfg.trainer.run_dir)
    tok, train, val = build_pair_datasets(cfg.data, run_dir)
    model_cfg = cfg.model.replace(vocab_size=tok.get_vocab_size(), max_len=max(cfg.model.max_len, cfg.data.max_len))
    task = ClassificationTask(
        model_cfg,
        cfg.method,
        train,
        val,
        cfg.data.batch_size,
        cfg.data.eval_batch_size,
        seed=cfg.trainer.seed,
        fixed_width=cfg.trainer.cuda_graphs,  # a captured step replays one shape
    )
    trainer = TransformerTrainer(task, cfg.trainer, _schedule_for(cfg.method, cfg.schedule), cfg.optim, cfg)
    summary = trainer.fit()
    return _finish(trainer, summary, cfg.method, run_dir)


def _finish(
    trainer: TransformerTrainer, summary: dict[str, Any], method: MethodConfig, run_dir: Path
) -> dict[str, Any]:
    ev = trainer.last_eval
    summary = {
        **summary,
        "method": method.name,
        "val_accuracy": ev.get("accuracy", float("nan")),
        "val_log_loss": ev.get("log_loss", float("nan")),
        "val_perplexity": ev.get("perplexity", float("nan")),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
    }
    summary.pop("val_auc", None)
    path = run_dir / "summary.json"
    if trainer.process_rank == 0 and path.exists():  # the engine's file: rank 0's alone
        saved = {k: v for k, v in json.loads(path.read_text()).items() if k != "val_auc"}
        path.write_text(json.dumps({**saved, **summary}, indent=1, default=str))
    return summary


# ----------------------------------------------------------------------------- masked LM


@dataclass
class CodeDataConfig:
    """The code corpus, its tokenizer and the masked-LM batches."""

    source: str = "stdlib"
    """"stdlib" (this Python's standard library), a folder of source files, or CodeSearchNet JSONL."""
    format: str = "auto"
    """"files", "jsonl" or "auto"."""
    extensions: list[str] = field(default_factory=lambda: [".py"])
    """Suffixes of source files read in "files" mode."""
    max_files: Optional[int] = 400
    """Read at most this many files / JSONL records (None: all)."""
    max_file_bytes: int = 200_000
    """Skip larger source files."""
    jsonl_field: str = "code"
    """JSONL field holding the code."""
    tokenizer_file: Optional[str] = None
    """A saved tokenizer.json to load; None trains a byte-level BPE on the corpus."""
    tokenizer_vocab_size: int = 8000
    """Vocabulary of a locally trained BPE tokenizer."""
    block_len: int = 128
    """Tokens per block (<s> ... </s>)."""
    val_fraction: float = 0.05
    """Share of the blocks held out for validation (every k-th block)."""
    mask_prob: float = 0.15
    """Share of tokens predicted."""
    batch_size: int = 32
    """Training blocks per process and step."""
    eval_batch_size: int = 64
    """Validation blocks per batch."""


@dataclass
class Phase2Config:
    """The second pre-training phase, which starts by compressing further."""

    enabled: bool = True
    """Run phase 2 after phase 1 (trainer.max_steps) ends."""
    steps: int = 100
    """Optimiser steps of phase 2."""
    rank_fraction: float = 0.5
    """At the start of phase 2 keep this share of every bond's rank (largest |D| first)."""
    cut_threshold: float = 0.05
    """At the start of phase 2 also cut ranks whose |D| is below this (phase 1 cuts at schedule.threshold)."""
    gamma: Optional[float] = None
    """Weight of the size surrogate in phase 2 (None: the same as phase 1)."""
    lr_scale: float = 1.0
    """Multiply every learning rate by this in phase 2."""


@dataclass
class MaskedLMRun:
    """A masked-LM (CodeBERT-style) pre-training run in two phases."""

    model: EncoderConfig = field(default_factory=lambda: EncoderConfig(type_vocab_size=1, layer_norm_eps=1e-5))
    """The encoder (vocab_size is set from the tokenizer)."""
    data: CodeDataConfig = field(default_factory=CodeDataConfig)
    """The code corpus."""
    method: MethodConfig = field(default_factory=MethodConfig)
    """compressed, dense, galore or lte."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The engine's loop settings (max_steps: phase 1)."""
    schedule: RankScheduleConfig = field(default_factory=RankScheduleConfig)
    """The rank-adaptive objective of phase 1."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The engine's optimiser."""
    phase2: Phase2Config = field(default_factory=Phase2Config)
    """Phase 2: compress further, then train on."""


def build_code_blocks(data: CodeDataConfig, block_len: int, run_dir: Optional[Path] = None):
    """Read the corpus, train or load the tokenizer, pack and split the blocks.

    Returns:
        ``(tokenizer, train blocks (N, L), val blocks (N_val, L), corpus)``.
    """
    corpus = read_code_corpus(
        data.source,
        format=data.format,
        extensions=data.extensions,
        max_files=data.max_files,
        max_file_bytes=data.max_file_bytes,
        jsonl_field=data.jsonl_field,
    )
    if not corpus.texts:
        raise ValueError(f"no code read from {data.source!r} ({corpus.skipped} files skipped)")
    tok = (
        load_tokenizer(data.tokenizer_file)
        if data.tokenizer_file
        else train_code_bpe(corpus.texts, data.tokenizer_vocab_size)
    )
    if run_dir is not None:
        save_tokenizer(tok, run_dir)
    streams = [e.ids for e in tok.encode_batch(corpus.texts)]
    blocks = pack_blocks(streams, block_len, special_id(tok, "<s>"), special_id(tok, "</s>"))
    if len(blocks) < 2:
        raise ValueError(f"the corpus gives only {len(blocks)} blocks of {block_len} tokens; read more files")
    every = max(2, round(1 / max(data.val_fraction, 1e-9)))
    is_val = torch.arange(len(blocks)) % every == every - 1
    return tok, blocks[~is_val], blocks[is_val], corpus


def run_masked_lm(cfg: MaskedLMRun) -> dict[str, Any]:
    """Pre-train a masked-LM in two phases with the engine.

    Phase 1 trains ``trainer.max_steps`` steps into ``run_dir/phase1``. Phase 2 builds
    the model from phase 1's last checkpoint, compresses further (``shrink_ranks`` at
    ``phase2.rank_fraction`` / ``phase2.cut_threshold``; uncompressed methods just go
    on), and trains ``phase2.steps`` more steps into ``run_dir/phase2`` with a fresh
    optimiser. Either phase resumes from its own checkpoints with ``trainer.resume``.

    Returns:
        ``{"phase1": summary, "phase2": summary or None, "corpus": {...}}``.
    """
    run_dir = Path(cfg.trainer.run_dir)
    tok, train, val, corpus = build_code_blocks(cfg.data, cfg.data.block_len, run_dir)
    model_cfg = cfg.model.replace(vocab_size=tok.get_vocab_size(), max_len=max(cfg.model.max_len, cfg.data.block_len))
    specials = [special_id(tok, t) for t in ("<s>", "</s>", "<pad>")]
    common = dict(
        mask_id=special_id(tok, "<mask>"),
        special_ids=specials,
        mask_prob=cfg.data.mask_prob,
        eval_batch_size=cfg.data.eval_batch_size,
        seed=cfg.trainer.seed,
    )
    corpus_info = {
        "texts": len(corpus.texts),
        "files_read": corpus.files_read,
        "skipped": corpus.skipped,
        "train_blocks": len(train),
        "val_blocks": len(val),
        "vocab_size": tok.get_vocab_size(),
    }
    print(f"corpus: {json.dumps(corpus_info)}", flush=True)
    phases = 2 if cfg.phase2.enabled else 1
    t1 = dataclasses.replace(
        cfg.trainer,
        run_dir=str(run_dir / "phase1") if phases == 2 else str(run_dir),
        checkpoint_at_end=True if phases == 2 else cfg.trainer.checkpoint_at_end,
    )
    task1 = MaskedLMTask(model_cfg, cfg.method, train, val, cfg.data.batch_size, **common)
    trainer1 = TransformerTrainer(task1, t1, _schedule_for(cfg.method, cfg.schedule), cfg.optim, cfg)
    out: dict[str, Any] = {"corpus": corpus_info, "phase2": None}
    out["phase1"] = _finish(trainer1, trainer1.fit(), cfg.method, Path(t1.run_dir))
    if phases == 1:
        return out
    last = latest_checkpoint(Path(t1.run_dir) / "checkpoints")
    if last is None:
        raise RuntimeError(f"phase 1 left no checkpoint in {t1.run_dir}/checkpoints")
    state = load_checkpoint(last)[0]["model"]
    p2 = cfg.phase2
    compress = cfg.method.compressed
    task2 = MaskedLMTask(
        model_cfg,
        cfg.method,
        train,
        val,
        cfg.data.batch_size,
        **common,
        init_state=state,
        rank_fraction=p2.rank_fraction if compress else 1.0,
        cut_threshold=p2.cut_threshold if compress else 0.0,
    )
    sched2 = _schedule_for(cfg.method, cfg.schedule)
    if p2.gamma is not None and compress:
        sched2 = dataclasses.replace(sched2, gamma=p2.gamma)
    optim2 = dataclasses.replace(
        cfg.optim,
        lr_cores=cfg.optim.lr_cores * p2.lr_scale,
        lr_controllers=cfg.optim.lr_controllers * p2.lr_scale,
        lr_other=cfg.optim.lr_other * p2.lr_scale,
    )
    # a resume after phase 1 finished may find phase 2 not yet started: that is a fresh phase 2
    t2 = dataclasses.replace(
        cfg.trainer,
        run_dir=str(run_dir / "phase2"),
        max_steps=p2.steps,
        seed=cfg.trainer.seed + 1,
        resume_missing_ok=True,
    )
    trainer2 = TransformerTrainer(task2, t2, sched2, optim2, cfg)
    out["phase2"] = _finish(trainer2, trainer2.fit(), cfg.method, Path(t2.run_dir))
    return out
