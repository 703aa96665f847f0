"""BERT / RoBERTa-style post-LN encoders whose big layers are tensor trains.

With ``EncoderConfig.compressed`` the token embedding is a :class:`TTMEmbedding` (a TTM
table looked up with the tensor core's de-duplicated ``ttm_rows``) and the Q, K, V,
output and both FFN layers are :class:`~comera_rec.tensor.TTLinear`; without it the same
classes hold ``nn.Embedding`` / ``nn.Linear`` (the dense twin used by the baselines).
Position and segment embeddings, LayerNorms, the pooler and the heads stay dense.

Shapes in comments: B batch, L sequence length, H heads, d_model = H * d_head, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from comera_rec.tensor import TTLinear, TTMEmbeddingBag, ttm_rows
from comera_rec.transformer.config import EncoderConfig

EMBEDDING_INIT_STD = 0.02


class TTMEmbedding(TTMEmbeddingBag):
    """``nn.Embedding`` with a TTM table: ids of any shape in, one row per id out.

    Each distinct id is computed once (row level) and each distinct prefix / suffix of
    its core slices once (tensor-index level, :func:`comera_rec.tensor.ttm_rows`); the
    rows are then expanded with the inverse map. Everything else (ranks, size, rank
    truncation, ``dense_weight()``, ``from_embedding``) is :class:`TTMEmbeddingBag`'s.

    Args:
        num_embeddings: rows of the table.
        embedding_dim: columns of the table.
        rank: rank of every internal bond, or one per bond.
        mode: unused by lookups (kept for ``TTMEmbeddingBag.from_embedding``).
        shape: ``(row_factors, column_factors)``; chosen by the tensor core when ``None``.
        init_std: standard deviation of the reconstructed table's entries at init.
        device: where to allocate.
        dtype: floating point dtype.

    Example::

        >>> emb = TTMEmbedding(1000, 16, rank=4)
        >>> emb(torch.tensor([[1, 2, 2], [999, 0, 1]])).shape
        torch.Size([2, 3, 16])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        rank: int | Sequence[int],
        *,
        mode: str = "sum",
        shape: tuple[Sequence[int], Sequence[int]] | None = None,
        init_std: float = EMBEDDING_INIT_STD,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.init_std = init_std
        super().__init__(num_embeddings, embedding_dim, rank, mode=mode, shape=shape, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """Entries of the reconstructed table with std ``init_std`` (BERT's 0.02)."""
        self._init_cores_normal(target_std=getattr(self, "init_std", EMBEDDING_INIT_STD))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``(...)`` int ids -> ``(..., embedding_dim)`` rows."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"TTMEmbedding: ids must be int32 or int64, got {ids.dtype}")
        flat = ids.reshape(-1).long()
        if self.static_shapes:  # capturable (CUDA graphs): no host reads, no de-duplication
            offsets = torch.arange(flat.numel() + 1, device=flat.device)  # one id per bag
            return super().forward(flat, offsets).reshape(*ids.shape, self.embedding_dim)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            bad = flat[(flat < 0) | (flat >= self.num_embeddings)][0]
            raise IndexError(f"TTMEmbedding: id {int(bad)} is outside [0, {self.num_embeddings})")
        unique, inverse = torch.unique(flat, return_inverse=True)  # (U,), (N,)
        cores = [c.unsqueeze(0) for c in self.scaled_cores()]  # one stacked train: (1, r, n, m, r')
        rows = ttm_rows(cores, self.row_shape, unique)[:, : self.embedding_dim]  # (U, D)
        return rows.index_select(0, inverse).reshape(*ids.shape, self.embedding_dim)


def _shape(value: Optional[list[list[int]]]) -> Optional[tuple[list[int], list[int]]]:
    return None if value is None else (list(value[0]), list(value[1]))


def make_linear(
    config: EncoderConfig, in_features: int, out_features: int, shape: Optional[list[list[int]]]
) -> nn.Module:
    """``TTLinear`` at ``config.rank`` when compressed, else ``nn.Linear``."""
    if config.compressed:
        return TTLinear(in_features, out_features, config.rank, shape=_shape(shape))
    return nn.Linear(in_features, out_features)


def make_token_embedding(config: EncoderConfig) -> nn.Module:
    """``TTMEmbedding`` at ``config.embedding_rank`` when compressed, else ``nn.Embedding``."""
    if config.compressed:
        return TTMEmbedding(
            config.vocab_size, config.d_model, config.embedding_rank, shape=_shape(config.embedding_shape)
        )
    emb = nn.Embedding(config.vocab_size, config.d_model)
    nn.init.normal_(emb.weight, std=EMBEDDING_INIT_STD)
    return emb


def embedding_table(module: nn.Module) -> torch.Tensor:
    """The ``(V, D)`` table of a token embedding (formed from the cores for a TTM)."""
    return module.dense_weight() if isinstance(module, TTMEmbedding) else module.weight


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate Q, K, V and output layers.

    Example::

        >>> attn = SelfAttention(EncoderConfig(vocab_size=50, num_layers=1, d_model=32, num_heads=4, d_ff=64, rank=4))
        >>> attn(torch.randn(2, 5, 32), torch.ones(2, 5, dtype=torch.bool)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        d, shape = config.d_model, config.attention_shape
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.query = make_linear(config, d, d, shape)
        self.key = make_linear(config, d, d, shape)
        self.value = make_linear(config, d, d, shape)
        self.output = make_linear(config, d, d, shape)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x (B, L, d_model)``, ``mask (B, L)`` True at real tokens -> ``(B, L, d_model)``."""
        B, L, d = x.shape
        H = self.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(B, L, H, d // H).transpose(1, 2)  # (B, H, L, d_head)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        attn_mask = mask[:, None, None, :]  # (B, 1, 1, L): keys a query may attend to
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, L, d_head)
        return self.output(ctx.transpose(1, 2).reshape(B, L, d))


class EncoderLayer(nn.Module):
    """Post-LN block: ``x = LN(x + attn(x)); x = LN(x + FFN(x))`` with GELU in the FFN."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn_in = make_linear(config, config.d_model, config.d_ff, config.ffn_in_shape)
        self.ffn_out = make_linear(config, config.d_ff, config.d_model, config.ffn_out_shape)
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B, L, d_model)`` -> ``(B, L, d_model)``."""
        x = self.attention_norm(x + self.drop(self.attention(x, mask)))
        h = self.ffn_out(F.gelu(self.ffn_in(x)))  # (B, L, d_ff) -> (B, L, d_model)
        return self.ffn_norm(x + self.drop(h))


class Encoder(nn.Module):
    """Token + position + segment embeddings, LayerNorm, then ``num_layers`` post-LN blocks.

    Args:
        config: sizes and compression settings.

    Example::

        >>> enc = Encoder(EncoderConfig(vocab_size=100, num_layers=1, d_model=32, num_heads=4, d_ff=64, rank=4, embedding_rank=4))
        >>> enc(torch.randint(0, 100, (2, 7))).shape
        torch.Size([2, 7, 32])
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = make_token_embedding(config)
        self.position_embedding = nn.Embedding(config.max_len, config.d_model)
        self.segment_embedding = nn.Embedding(config.type_vocab_size, config.d_model)
        for emb in (self.position_embedding, self.segment_embedding):
            nn.init.normal_(emb.weight, std=EMBEDDING_INIT_STD)
        self.embedding_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([EncoderLayer(config) for _ in range(config.num_layers)])

    def forward(
        self,
        ids: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Encode a batch.

        Args:
            ids: ``(B, L)`` token ids, ``L <= max_len``.
            mask: ``(B, L)`` True (or 1) at real tokens; all True when ``None``.
            segments: ``(B, L)`` segment ids; all 0 when ``None``.

        Returns:
            ``(B, L, d_model)`` hidden states.
        """
        if ids.dim() != 2:
            raise ValueError(f"Encoder: ids must be (batch, length), got shape {tuple(ids.shape)}")
        B, L = ids.shape
        if L > self.config.max_len:
            raise ValueError(f"Encoder: sequence length {L} exceeds max_len={self.config.max_len}")
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        positions = torch.arange(L, device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)[None]  # (B, L, d_model)
        if segments is not None:
            x = x + self.segment_embedding(segments)
        else:
            x = x + self.segment_embedding.weight[0]
        x = self.drop(self.embedding_norm(x))
        for layer in self.layers:
            x = layer(x, mask)
        return x


class SequenceClassifier(nn.Module):
    """Encoder + BERT pooler (dense + tanh on the first token) + linear classifier.

    Args:
        config: sizes, ``num_labels`` and compression settings.

    Example::

        >>> cfg = EncoderConfig(vocab_size=100, num_layers=1, d_model=32, num_heads=4, d_ff=64, rank=4, embedding_rank=4)
        >>> SequenceClassifier(cfg)(torch.randint(0, 100, (2, 7))).shape
        torch.Size([2, 3])
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.pooler = nn.Linear(config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)

    def forward(
        self,
        ids: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        segments: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``ids (B, L)`` (+ mask, segments) -> logits ``(B, num_labels)``."""
        h = self.encoder(ids, mask, segments)  # (B, L, d_model)
        pooled = torch.tanh(self.pooler(h[:, 0]))  # (B, d_model)
        return self.classifier(self.drop(pooled))


class MaskedLM(nn.Module):
    """RoBERTa-style masked-LM: encoder + (dense, GELU, LayerNorm) + vocabulary decoder.

    The decoder is tied to the token embedding (``decoder="tied"``: logits are
    ``h @ E^T + b``, with ``E`` formed from the TTM cores once per forward) or a separate
    dense layer.

    Args:
        config: sizes and compression settings.

    Example::

        >>> cfg = EncoderConfig(vocab_size=100, num_layers=1, d_model=32, num_heads=4, d_ff=64, rank=4, embedding_rank=4)
        >>> ids = torch.randint(0, 100, (2, 7))
        >>> MaskedLM(cfg)(ids, positions=ids > 50).shape[1]
        100
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.transform = nn.Linear(config.d_model, config.d_model)
        self.transform_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.d_model, config.vocab_size) if config.decoder == "dense" else None
        self.decoder_bias = nn.Parameter(torch.zeros(config.vocab_size)) if self.decoder is None else None

    def forward(
        self,
        ids: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Vocabulary logits.

        Args:
            ids: ``(B, L)`` token ids (masked ones already replaced).
            mask: ``(B, L)`` True at real tokens.
            positions: ``(B, L)`` bool: score only these positions (the masked ones).

        Returns:
            ``(M, V)`` logits of the selected positions in row-major order, or
            ``(B, L, V)`` when ``positions`` is ``None``.
        """
        h = self.encoder(ids, mask)  # (B, L, d_model)
        if positions is not None:
            h = h[positions.bool()]  # (M, d_model)
        h = self.transform_norm(F.gelu(self.transform(h)))
        if self.decoder is not None:
            return self.decoder(h)
        return F.linear(h, embedding_table(self.encoder.token_embedding), self.decoder_bias)


@torch.no_grad()
def dense_twin(model: nn.Module) -> nn.Module:
    """The dense model with the same function: TT weights replaced by their reconstruction.

    Builds the same class with ``compressed=False`` and copies every weight: each
    ``TTLinear`` becomes an ``nn.Linear`` holding ``dense_weight()`` and the bias, the
    ``TTMEmbedding`` an ``nn.Embedding`` holding its table, and every other parameter is
    copied by name.

    Args:
        model: a :class:`SequenceClassifier` or :class:`MaskedLM`.

    Returns:
        The dense twin in the same train / eval mode.

    Example::

        >>> cfg = EncoderConfig(vocab_size=100, num_layers=1, d_model=32, num_heads=4, d_ff=64, rank=4, embedding_rank=4, dropout=0.0)
        >>> tt = SequenceClassifier(cfg).eval()
        >>> ids = torch.randint(0, 100, (2, 7))
        >>> torch.allclose(tt(ids), dense_twin(tt)(ids), atol=1e-5)
        True
    """
    config: EncoderConfig = model.config  # type: ignore[assignment]
    twin = type(model)(config.replace(compressed=False))
    state = {}
    tt_prefixes = []
    for name, module in model.named_modules():
        if isinstance(module, TTMEmbedding):
            state[f"{name}.weight"] = module.dense_weight()
            tt_prefixes.append(name + ".")
        elif isinstance(module, TTLinear):
            state[f"{name}.weight"] = module.dense_weight()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
            tt_prefixes.append(name + ".")
    for name, tensor in model.state_dict().items():
        if not any(name.startswith(p) for p in tt_prefixes):
            state[name] = tensor
    twin.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    twin.train(model.training)
    return twin.to(next(model.parameters()).device)


def count_parameters(model: nn.Module) -> int:
    """Stored parameters (trainable or frozen) of ``model``."""
    return sum(p.numel() for p in model.parameters())


def dense_parameter_count(config: EncoderConfig, head: str = "classifier") -> int:
    """Parameters of the dense model of ``config`` (built on the meta device, no memory).

    Example::

        >>> from comera_rec.transformer.config import encoder_preset
        >>> round(dense_parameter_count(encoder_preset("codebert-large"), head="mlm") / 1e6)
        355
    """
    with torch.device("meta"):
        cls = SequenceClassifier if head == "classifier" else MaskedLM
        return count_parameters(cls(config.replace(compressed=False)))


def flops_per_token(config: EncoderConfig) -> float:
    """Dense forward multiply-adds per token of the encoder's linear layers (x2 for FLOPs)."""
    d, f = config.d_model, config.d_ff
    return 2.0 * config.num_layers * (4 * d * d + 2 * d * f)


def param_norm(model: nn.Module) -> float:
    """L2 norm of all parameters (a cheap check that a step changed something)."""
    return math.sqrt(sum(float(p.detach().float().pow(2).sum()) for p in model.parameters()))
