"""Encoder configurations: a dataclass of flat fields and named presets.

The reference six-encoder (method.md section 4) compresses the token embedding into a TTM
table ``[16,20,10,10] x [4,4,8,6]`` and every Q/K/V/output and FFN layer into a TT
layer; :func:`encoder_preset` returns it and the other sizes by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

# Reference TT / TTM shapes of the six-encoder at d_model 768, d_ff 3072 (method.md section 4).
REFERENCE_EMBEDDING_SHAPE: list[list[int]] = [[16, 20, 10, 10], [4, 4, 8, 6]]
REFERENCE_ATTENTION_SHAPE: list[list[int]] = [[12, 8, 8], [8, 8, 12]]
REFERENCE_FFN_IN_SHAPE: list[list[int]] = [[12, 8, 8], [12, 16, 16]]
REFERENCE_FFN_OUT_SHAPE: list[list[int]] = [[16, 16, 12], [8, 8, 12]]


@dataclass
class EncoderConfig:
    """A BERT / RoBERTa-style post-LN encoder, compressed or dense.

    Example::

        >>> cfg = EncoderConfig(vocab_size=500, num_layers=2, d_model=64, num_heads=4, d_ff=128)
        >>> cfg.head_dim
        16
    """

    vocab_size: int = 30522
    """Rows of the token embedding (the tokenizer's vocabulary size)."""
    max_len: int = 128
    """Longest sequence (rows of the position embedding)."""
    type_vocab_size: int = 2
    """Segment ids (2 for sentence pairs; 1 for RoBERTa-style masked-LM)."""
    num_layers: int = 6
    """Encoder layers."""
    d_model: int = 768
    """Hidden size."""
    num_heads: int = 12
    """Attention heads; must divide d_model."""
    d_ff: int = 3072
    """Inner size of the feed-forward block."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches."""
    layer_norm_eps: float = 1e-12
    """Epsilon of every LayerNorm."""
    num_labels: int = 3
    """Classes of the sequence classifier (ignored by the masked-LM)."""
    compressed: bool = True
    """TTM token embedding and TT linear layers (False: the dense twin, nn.Embedding / nn.Linear)."""
    rank: int = 30
    """TT rank of the Q/K/V/output and FFN layers (reference 30)."""
    embedding_rank: int = 32
    """TT rank of the TTM token embedding (reference ranks [1,32,32,32,1])."""
    embedding_shape: Optional[list[list[int]]] = None
    """TTM shape [row factors, column factors]; None chooses one (tensor core's ttm_shape)."""
    attention_shape: Optional[list[list[int]]] = None
    """TT shape [input factors, output factors] of Q, K, V and the output projection; None chooses one."""
    ffn_in_shape: Optional[list[list[int]]] = None
    """TT shape of the d_model -> d_ff layer; None chooses one."""
    ffn_out_shape: Optional[list[list[int]]] = None
    """TT shape of the d_ff -> d_model layer; None chooses one."""
    decoder: Literal["tied", "dense"] = "tied"
    """Masked-LM output layer: "tied" to the token embedding (RoBERTa) or a separate dense layer."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "max_len",
            "type_vocab_size",
            "num_layers",
            "d_model",
            "num_heads",
            "d_ff",
            "num_labels",
            "rank",
            "embedding_rank",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EncoderConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"EncoderConfig: num_heads={self.num_heads} must divide d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"EncoderConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("embedding_shape", "attention_shape", "ffn_in_shape", "ffn_out_shape"):
            value = getattr(self, name)
            if value is not None and (len(value) != 2 or not all(len(side) for side in value)):
                raise ValueError(f"EncoderConfig.{name} must be two lists of factors [[...], [...]], got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def replace(self, **changes: object) -> "EncoderConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def encoder_preset(name: str, **overrides: object) -> EncoderConfig:
    """A named encoder size, optionally with fields changed.

    Presets:
        ``"reference"``: the six-encoder of method.md section 4 (6 / 768 / 12 / 3072,
        sequence 128, BERT vocabulary 30522) with its TT / TTM shapes.
        ``"tiny"``: 2 / 64 / 4 / 128, for tests and demos.
        ``"small"``: 4 / 128 / 4 / 512.
        ``"codebert-base"``: RoBERTa-base (12 / 768 / 12 / 3072, vocabulary 50265, 514 positions).
        ``"codebert-large"``: RoBERTa-large (24 / 1024 / 16 / 4096; 357M parameters dense).

    Example::

        >>> encoder_preset("reference").embedding_shape
        [[16, 20, 10, 10], [4, 4, 8, 6]]
        >>> encoder_preset("tiny", vocab_size=300).vocab_size
        300
    """
    presets: dict[str, dict[str, object]] = {
        "reference": dict(
            vocab_size=30522,
            max_len=128,
            num_layers=6,
            d_model=768,
            num_heads=12,
            d_ff=3072,
            embedding_shape=REFERENCE_EMBEDDING_SHAPE,
            attention_shape=REFERENCE_ATTENTION_SHAPE,
            ffn_in_shape=REFERENCE_FFN_IN_SHAPE,
            ffn_out_shape=REFERENCE_FFN_OUT_SHAPE,
        ),
        "tiny": dict(
            vocab_size=1000, max_len=64, num_layers=2, d_model=64, num_heads=4, d_ff=128, rank=8, embedding_rank=8
        ),
        "small": dict(
            vocab_size=4000, max_len=128, num_layers=4, d_model=128, num_heads=4, d_ff=512, rank=16, embedding_rank=16
        ),
        "codebert-base": dict(
            vocab_size=50265,
            max_len=514,
            type_vocab_size=1,
            num_layers=12,
            d_model=768,
            num_heads=12,
            d_ff=3072,
            layer_norm_eps=1e-5,
            attention_shape=REFERENCE_ATTENTION_SHAPE,
            ffn_in_shape=REFERENCE_FFN_IN_SHAPE,
            ffn_out_shape=REFERENCE_FFN_OUT_SHAPE,
        ),
        "codebert-large": dict(
            vocab_size=50265,
            max_len=514,
            type_vocab_size=1,
            num_layers=24,
            d_model=1024,
            num_heads=16,
            d_ff=4096,
            layer_norm_eps=1e-5,
        ),
    }
    if name not in presets:
        raise ValueError(f"encoder_preset: unknown preset {name!r}; choose one of {sorted(presets)}")
    return EncoderConfig(**{**presets[name], **overrides})  # type: ignore[arg-type]
