"""Data for the transformer backbones: sentence pairs (GLUE TSV or a synthetic task) and
code corpora for masked-LM pre-training.

Sentence pairs:
    :func:`read_nli_tsv` reads MNLI-style TSV files (``train.tsv``, ``dev_matched.tsv``:
    columns ``sentence1``, ``sentence2``, ``gold_label`` found by header name);
    :func:`synthetic_nli` generates a learnable three-label task offline;
    :class:`PairDataset` holds encoded pairs and yields deterministic batches.

Code:
    :func:`read_code_corpus` reads a directory of source files (by default the Python
    standard library) or CodeSearchNet JSONL (``.jsonl`` / ``.jsonl.gz``), skipping
    unreadable files with a count; :func:`pack_blocks` turns token streams into
    ``<s> ... </s>`` blocks; :func:`mask_tokens` applies RoBERTa's 80/10/10 masking.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

NLI_LABELS = ("entailment", "neutral", "contradiction")
"""Label ids of sentence-pair classification (the order of GLUE MNLI in HF datasets)."""

# ----------------------------------------------------------------------------- sentence pairs


@dataclass
class PairExamples:
    """Raw sentence pairs: ``firsts[i]``, ``seconds[i]`` and label id ``labels[i]``."""

    firsts: list[str]
    seconds: list[str]
    labels: list[int]
    skipped: int = 0
    """Rows left out (no gold label, too few columns)."""

    def __len__(self) -> int:
        return len(self.labels)


def read_nli_tsv(path: str | Path, max_rows: Optional[int] = None) -> PairExamples:
    """Read an MNLI-style TSV file (GLUE layout).

    Columns are found by header name: ``sentence1``, ``sentence2`` and ``gold_label``
    (``train.tsv`` and ``dev_matched.tsv`` differ in the other columns). Rows whose gold
    label is ``-`` or unknown, or with missing columns, are skipped and counted.

    Args:
        path: the TSV file.
        max_rows: stop after this many kept rows.

    Example::

        >>> import tempfile, os
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     p = os.path.join(folder, "dev.tsv")
        ...     _ = open(p, "w").write("index\\tsentence1\\tsentence2\\tgold_label\\n0\\tA man.\\tA person.\\tentailment\\n1\\tx\\ty\\t-\\n")
        ...     ex = read_nli_tsv(p)
        >>> ex.labels, ex.skipped
        ([0], 1)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"read_nli_tsv: no file at {path}")
    label_of = {name: i for i, name in enumerate(NLI_LABELS)}
    out = PairExamples([], [], [])
    csv.field_size_limit(sys.maxsize)
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"read_nli_tsv: {path} is empty")
        try:
            c1, c2, cl = (header.index(name) for name in ("sentence1", "sentence2", "gold_label"))
        except ValueError:
            raise ValueError(
                f"read_nli_tsv: {path} needs columns sentence1, sentence2 and gold_label; header is {header}"
            ) from None
        for row in reader:
            if len(row) <= max(c1, c2, cl) or row[cl] not in label_of:
                out.skipped += 1
                continue
            out.firsts.append(row[c1])
            out.seconds.append(row[c2])
            out.labels.append(label_of[row[cl]])
            if max_rows is not None and len(out) >= max_rows:
                break
    return out


def _word_list(n: int, rng: random.Random) -> list[str]:
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 3))))
    return sorted(words)


def synthetic_nli(
    num_examples: int,
    seed: int = 0,
    *,
    num_words: int = 24,
    premise_words: tuple[int, int] = (5, 9),
    hypothesis_words: tuple[int, int] = (2, 4),
) -> PairExamples:
    """A learnable three-label sentence-pair task, generated offline.

    The premise is a few distinct words from a fixed made-up vocabulary (the same for
    every seed). The hypothesis takes words of the premise, in order, and:

    - **entailment**: nothing else;
    - **contradiction**: the word ``not`` inserted somewhere;
    - **neutral**: its words replaced by words absent from the premise, and ``not``
      inserted half of the time.

    So the label follows from two features: whether the hypothesis words occur in the
    premise (cross-sentence overlap, which attention must find) and whether ``not`` occurs.
    Labels are balanced.

    Args:
        num_examples: pairs to generate.
        seed: the generator seed (examples, not vocabulary).
        num_words: size of the made-up vocabulary.
        premise_words: (min, max) words of a premise.
        hypothesis_words: (min, max) premise words taken into a hypothesis.

    Example::

        >>> ex = synthetic_nli(6, seed=1)
        >>> len(ex), sorted(set(ex.labels))
        (6, [0, 1, 2])
    """
    words = _word_list(num_words, random.Random(1234))
    rng = random.Random(seed)
    out = PairExamples([], [], [])
    for i in range(num_examples):
        label = i % 3
        premise = rng.sample(words, rng.randint(*premise_words))
        k = min(rng.randint(*hypothesis_words), len(premise))
        picks = sorted(rng.sample(range(len(premise)), k))
        hyp = [premise[j] for j in picks]
        negate = label == 2 or (label == 1 and rng.random() < 0.5)
        if label == 1:
            absent = [w for w in words if w not in premise]
            hyp = rng.sample(absent, len(hyp))
        if negate:
            hyp.insert(rng.randint(0, len(hyp)), "not")
        out.firsts.append(" ".join(premise) + " .")
        out.seconds.append(" ".join(hyp) + " .")
        out.labels.append(label)
    order = list(range(num_examples))
    rng.shuffle(order)
    return PairExamples([out.firsts[i] for i in order], [out.seconds[i] for i in order], [out.labels[i] for i in order])


class PairDataset:
    """Encoded sentence pairs with deterministic, trimmed batches.

    Args:
        ids: ``(N, L)`` token ids (``[CLS] a [SEP] b [SEP]``, padded).
        segments: ``(N, L)`` segment ids.
        mask: ``(N, L)`` True at real tokens.
        labels: ``(N,)`` label ids.

    Example::

        >>> ds = PairDataset(torch.ones(5, 8, dtype=torch.long), torch.zeros(5, 8, dtype=torch.long),
        ...                  torch.arange(8).expand(5, 8) < 3, torch.tensor([0, 1, 2, 0, 1]))
        >>> [b["ids"].shape for b in ds.batches(2, shuffle=False)]
        [torch.Size([2, 3]), torch.Size([2, 3]), torch.Size([1, 3])]
    """

    def __init__(self, ids: torch.Tensor, segments: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> None:
        if not (ids.shape == segments.shape == mask.shape and labels.shape == ids.shape[:1]):
            raise ValueError(
                f"PairDataset: shapes disagree: ids {tuple(ids.shape)}, segments {tuple(segments.shape)}, "
                f"mask {tuple(mask.shape)}, labels {tuple(labels.shape)}"
            )
        self.ids, self.segments, self.mask, self.labels = ids, segments, mask.bool(), labels.long()

    @classmethod
    def from_examples(cls, tok, examples: PairExamples, max_len: int) -> "PairDataset":
        """Encode raw pairs with a WordPiece tokenizer (see ``encode_pairs``)."""
        from comera_rec.transformer.tokenizer import encode_pairs

        enc = encode_pairs(tok, examples.firsts, examples.seconds, max_len)
        return cls(enc["ids"], enc["segments"], enc["mask"], torch.tensor(examples.labels, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shard: tuple[int, int] = (0, 1),
        drop_last: bool = False,
        fixed_width: bool = False,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield ``{"ids", "segments", "mask", "labels"}`` batches, trimmed to their longest row.

        Args:
            batch_size: rows per batch.
            shuffle: permute with ``seed`` (deterministic).
            seed: permutation seed (e.g. the epoch).
            shard: ``(rank, world)``: this process takes every world-th row.
            drop_last: leave out a last, smaller batch.
            fixed_width: keep every batch at the full padded width ``L`` instead (a CUDA
                graph replays one shape).
        """
        n = len(self)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(n)
        rank, world = shard
        order = order[: n - n % world][rank::world]  # equal shards: every process runs as many batches
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            if drop_last and len(idx) < batch_size:
                return
            width = self.ids.shape[1] if fixed_width else int(self.mask[idx].sum(dim=1).max())
            yield {
                "ids": self.ids[idx, :width],
                "segments": self.segments[idx, :width],
                "mask": self.mask[idx, :width],
                "labels": self.labels[idx],
            }


# ----------------------------------------------------------------------------- code corpus


@dataclass
class CodeCorpus:
    """Texts read from a code corpus, and what was left out."""

    texts: list[str] = field(default_factory=list)
    """One entry per file (or per JSONL record)."""
    files_read: int = 0
    """Files that were read (JSONL files count once)."""
    skipped: int = 0
    """Files (or JSONL lines) that could not be read or decoded."""
    skipped_examples: list[str] = field(default_factory=list)
    """The first few skipped paths with their error, for the log."""

    def _skip(self, what: str, error: BaseException) -> None:
        self.skipped += 1
        if len(self.skipped_examples) < 10:
            self.skipped_examples.append(f"{what}: {type(error).__name__}: {error}")


def default_code_root() -> Path:
    """The Python standard library of this interpreter (present on every machine)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _jsonl_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz")))


def read_code_corpus(
    source: str | Path = "stdlib",
    *,
    format: str = "auto",
    extensions: Sequence[str] = (".py",),
    max_files: Optional[int] = None,
    max_file_bytes: int = 200_000,
    jsonl_field: str = "code",
) -> CodeCorpus:
    """Read source code for masked-LM pre-training.

    Args:
        source: ``"stdlib"`` (this Python's standard library), a directory of source
            files, a CodeSearchNet ``.jsonl`` / ``.jsonl.gz`` file, or a directory of them.
        format: ``"files"``, ``"jsonl"`` or ``"auto"`` (JSONL when ``source`` is such a
            file or a directory holding any, else source files).
        extensions: file suffixes read in ``"files"`` mode.
        max_files: stop after this many texts (files in ``"files"`` mode, records in
            ``"jsonl"`` mode).
        max_file_bytes: larger source files are skipped (generated tables, not code to learn from).
        jsonl_field: the record field holding the code (CodeSearchNet: ``"code"``;
            ``"original_string"`` is the fallback).

    Returns:
        A :class:`CodeCorpus`; files that cannot be read or decoded as UTF-8 (and JSONL
        lines that do not parse) are counted in ``skipped``, never raised.

    Example::

        >>> corpus = read_code_corpus("stdlib", max_files=3)
        >>> len(corpus.texts)
        3
    """
    root = default_code_root() if str(source) == "stdlib" else Path(source)
    if not root.exists():
        raise FileNotFoundError(f"read_code_corpus: {root} does not exist")
    if format == "auto":
        format = "jsonl" if _jsonl_files(root) and (root.is_file() or not _has_sources(root, extensions)) else "files"
    if format not in ("files", "jsonl"):
        raise ValueError(f"read_code_corpus: format must be auto, files or jsonl, got {format!r}")
    corpus = CodeCorpus()
    if format == "jsonl":
        for path in _jsonl_files(root):
            try:
                opener = gzip.open if path.name.endswith(".gz") else open
                with opener(path, "rt", encoding="utf-8") as f:
                    corpus.files_read += 1
                    for n, line in enumerate(f):
                        try:
                            record = json.loads(line)
                            text = record.get(jsonl_field) or record["original_string"]
                        except (ValueError, KeyError, AttributeError) as e:
                            corpus._skip(f"{path}:{n + 1}", e)
                            continue
                        corpus.texts.append(text)
                        if max_files is not None and len(corpus.texts) >= max_files:
                            return corpus
            except (OSError, UnicodeDecodeError, EOFError) as e:
                corpus._skip(str(path), e)
        return corpus
    for path in _source_files(root, extensions):
        try:
            if path.stat().st_size > max_file_bytes:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            corpus._skip(str(path), e)
            continue
        corpus.files_read += 1
        if text.strip():
            corpus.texts.append(text)
        if max_files is not None and len(corpus.texts) >= max_files:
            break
    return corpus


def _source_files(root: Path, extensions: Sequence[str]) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root, onerror=None):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(tuple(extensions)):
                yield Path(dirpath) / name


def _has_sources(root: Path, extensions: Sequence[str]) -> bool:
    return next(_source_files(root, extensions), None) is not None


def pack_blocks(token_streams: Sequence[Sequence[int]], block_len: int, bos: int, eos: int) -> torch.Tensor:
    """Concatenate token streams (separated by ``eos``) and cut ``<s> ... </s>`` blocks.

    Args:
        token_streams: one id list per text.
        block_len: width of each block, ``<s>`` and ``</s>`` included (>= 3).
        bos: id of ``<s>``.
        eos: id of ``</s>``.

    Returns:
        ``(N, block_len)`` int64; the incomplete tail is left out.

    Example::

        >>> pack_blocks([[5, 6, 7], [8]], block_len=4, bos=0, eos=2).tolist()
        [[0, 5, 6, 2], [0, 7, 2, 2], [0, 8, 2, 2]]
    """
    if block_len < 3:
        raise ValueError(f"pack_blocks: block_len must be >= 3, got {block_len}")
    flat: list[int] = []
    for stream in token_streams:
        flat.extend(stream)
        flat.append(eos)
    body = block_len - 2
    n = len(flat) // body
    if n == 0:
        return torch.empty(0, block_len, dtype=torch.long)
    inner = torch.tensor(flat[: n * body], dtype=torch.long).reshape(n, body)
    ends = torch.full((n, 1), eos, dtype=torch.long)
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long), inner, ends], dim=1)


def mask_tokens(
    ids: torch.Tensor,
    generator: torch.Generator,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
    prob: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoBERTa masking: pick ``prob`` of the non-special tokens; of those, 80% become
    ``<mask>``, 10% a random token, 10% stay.

    Args:
        ids: ``(B, L)`` token ids.
        generator: the source of randomness (deterministic batches).
        mask_id: id of ``<mask>``.
        vocab_size: random replacements are drawn from ``[0, vocab_size)``.
        special_ids: ids never picked (``<s>``, ``</s>``, ``<pad>``).
        prob: fraction of tokens to predict.

    Returns:
        ``(inputs, labels)``: ``labels`` holds the original id at picked positions and
        -100 elsewhere; at least one position per batch is picked.

    Example::

        >>> x, y = mask_tokens(torch.arange(10, 30).reshape(2, 10), torch.Generator().manual_seed(0),
        ...                    mask_id=4, vocab_size=50, special_ids=[0, 1, 2])
        >>> bool(((y == -100) | (y == torch.arange(10, 30).reshape(2, 10))).all())
        True
    """
    special = torch.zeros_like(ids, dtype=torch.bool)
    for s in special_ids:
        special |= ids == s
    pick = (torch.rand(ids.shape, generator=generator) < prob) & ~special
    if not bool(pick.any()):
        candidates = (~special).nonzero()
        if len(candidates):
            i = int(torch.randint(len(candidates), (1,), generator=generator))
            pick[tuple(candidates[i])] = True
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    inputs = ids.clone()
    inputs[pick & (roll < 0.8)] = mask_id
    random_pos = pick & (roll >= 0.8) & (roll < 0.9)
    inputs[random_pos] = torch.randint(vocab_size, (int(random_pos.sum()),), generator=generator)
    return inputs, labels
