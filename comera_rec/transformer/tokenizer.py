"""Tokenizers built with HF ``tokenizers``: BERT WordPiece for sentence pairs, byte-level
BPE (RoBERTa-style) for code. Both are trained locally in seconds or loaded from files.

Example::

    >>> tok = train_wordpiece(["the cat sat on the mat", "a dog sat"] * 20, vocab_size=100)
    >>> tok.decode(tok.encode("the cat sat").ids)
    'the cat sat'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


def _bert_pipeline(tok: Tokenizer, lowercase: bool) -> Tokenizer:
    tok.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, clean_text=True, handle_chinese_chars=True, strip_accents=None
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _bert_post_processor(tok: Tokenizer) -> None:
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    if cls_id is None or sep_id is None:
        raise ValueError("WordPiece vocabulary lacks [CLS] or [SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )


def train_wordpiece(
    texts: Iterable[str], vocab_size: int = 8000, *, min_frequency: int = 1, lowercase: bool = True
) -> Tokenizer:
    """Train a BERT WordPiece tokenizer on ``texts``.

    Args:
        texts: training sentences (any iterable, read once).
        vocab_size: largest vocabulary (special tokens included).
        min_frequency: pieces seen fewer times are left out.
        lowercase: lowercase before splitting (BERT uncased).

    Returns:
        A tokenizer whose pair encoding is ``[CLS] a [SEP] b [SEP]`` with segment ids 0 / 1.

    Example::

        >>> tok = train_wordpiece(["hello world"] * 5, vocab_size=60)
        >>> tok.encode("hello", "world").tokens
        ['[CLS]', 'hello', '[SEP]', 'world', '[SEP]']
    """
    tok = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")), lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(BERT_SPECIALS), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    _bert_post_processor(tok)
    return tok


def load_wordpiece(vocab_file: str | Path, *, lowercase: bool = True) -> Tokenizer:
    """A BERT WordPiece tokenizer from a ``vocab.txt`` (one piece a line, BERT's format).

    Example::

        >>> import tempfile, os
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "vocab.txt")
        ...     _ = open(path, "w").write("\\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hi", "##s"]))
        ...     print(load_wordpiece(path).encode("his").tokens)
        ['[CLS]', 'hi', '##s', '[SEP]']
    """
    path = Path(vocab_file)
    if not path.is_file():
        raise FileNotFoundError(f"load_wordpiece: no vocabulary file at {path}")
    tok = _bert_pipeline(Tokenizer(models.WordPiece.from_file(str(path), unk_token="[UNK]")), lowercase)
    _bert_post_processor(tok)
    return tok


def train_code_bpe(texts: Iterable[str], vocab_size: int = 8000, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer (RoBERTa / CodeBERT style) on source code.

    Byte-level pieces cover every input, so ``decode(encode(text))`` returns the text
    exactly (whitespace included). Special tokens: ``<s> <pad> </s> <unk> <mask>``.

    Example::

        >>> tok = train_code_bpe(["def f(x):\\n    return x\\n"] * 10, vocab_size=300)
        >>> tok.decode(tok.encode("def g(y):\\n    return y\\n").ids)
        'def g(y):\\n    return y\\n'
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(ROBERTA_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, run_dir: str | Path) -> Path:
    """Write ``run_dir/tokenizer.json`` atomically (a private part file, then a rename).

    Every process of a torchrun job trains the same tokenizer and saves it: each writes
    its own part file, so the file a reader finds is always one complete copy.

    Returns:
        The path written.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "tokenizer.json"
    part = run_dir / f".tokenizer.json.{os.getpid()}.part"
    tok.save(str(part))
    os.replace(part, path)
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer saved with ``Tokenizer.save`` (``tokenizer.json``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_tokenizer: no tokenizer file at {path}")
    return Tokenizer.from_file(str(path))


def special_id(tok: Tokenizer, token: str) -> int:
    """The id of a special token, with a clear error when the vocabulary lacks it."""
    idx = tok.token_to_id(token)
    if idx is None:
        raise ValueError(f"tokenizer vocabulary has no {token!r}")
    return idx


def encode_pairs(
    tok: Tokenizer, firsts: Sequence[str], seconds: Sequence[str], max_len: int
) -> dict[str, torch.Tensor]:
    """Encode sentence pairs into fixed-width tensors (truncated, padded with ``[PAD]``).

    Args:
        tok: a WordPiece tokenizer from :func:`train_wordpiece` / :func:`load_wordpiece`.
        firsts: first sentences (premises).
        seconds: second sentences (hypotheses), as many as ``firsts``.
        max_len: width of the output (special tokens included).

    Returns:
        ``{"ids", "segments"}`` int64 ``(N, max_len)``, ``"mask"`` bool ``(N, max_len)``
        and ``"lengths"`` int64 ``(N,)``.

    Example::

        >>> tok = train_wordpiece(["a b c"] * 5, vocab_size=40)
        >>> encode_pairs(tok, ["a b"], ["c"], 8)["ids"].shape
        torch.Size([1, 8])
    """
    if len(firsts) != len(seconds):
        raise ValueError(f"encode_pairs: {len(firsts)} first sentences but {len(seconds)} second ones")
    pad = special_id(tok, "[PAD]")
    tok.enable_truncation(max_length=max_len, strategy="longest_first")
    tok.no_padding()
    try:
        encodings = tok.encode_batch(list(zip(firsts, seconds)))
    finally:
        tok.no_truncation()
    n = len(encodings)
    ids = torch.full((n, max_len), pad, dtype=torch.long)
    segments = torch.zeros((n, max_len), dtype=torch.long)
    lengths = torch.zeros(n, dtype=torch.long)
    for i, enc in enumerate(encodings):
        k = len(enc.ids)
        ids[i, :k] = torch.tensor(enc.ids, dtype=torch.long)
        segments[i, :k] = torch.tensor(enc.type_ids, dtype=torch.long)
        lengths[i] = k
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    return {"ids": ids, "segments": segments, "mask": mask, "lengths": lengths}
