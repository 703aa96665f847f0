"""The masked-item (BERT4Rec-style) model: item embeddings through a TorchRec embedding
collection, a transformer encoder, and scores against the item table.

The item table holds ``num_items + 1`` rows: the items, then the mask token. Its
sequences come in as a ``KeyedJaggedTensor`` with one key (``"items"``), so the table can
be TorchRec's ``EmbeddingCollection`` (dense) or comera-rec's ``TTMEmbeddingCollection``
(TT, the same interface): the model never looks inside. The output layer scores the
encoder's state at the picked positions against every item row (weights tied to the
input table, plus a bias per item), so a compressed table compresses both ends.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from comera_rec.integration.embedding_collection import TTMEmbeddingCollection
from comera_rec.sequence.config import ITEM_FEATURE, ITEM_TABLE, SeqModelConfig


def item_kjt(values: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
    """The model's input: one KJT key (``"items"``) holding the jagged sequences."""
    return KeyedJaggedTensor(keys=[ITEM_FEATURE], values=values, lengths=lengths)


def jagged_to_padded(values: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``(B, max_len, D)`` rows of ``values (N, D)``, sequence b in row b from position 0,
    zeros after its end (differentiable; lengths must be <= max_len)."""
    batch = lengths.numel()
    rows = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths, output_size=values.shape[0])
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(values.shape[0], device=values.device) - starts[rows]
    out = values.new_zeros(batch * max_len, values.shape[1])
    return out.index_copy(0, rows * max_len + cols, values).view(batch, max_len, -1)


def from_end_positions(lengths: torch.Tensor, longest: int) -> torch.Tensor:
    """``(B, longest)`` position of each slot counted back from its sequence's last item
    (0 = last); padding slots get 0 (they are masked out of attention).

    Example::

        >>> from_end_positions(torch.tensor([3, 1]), 3)
        tensor([[2, 1, 0],
                [0, 0, 0]])
    """
    slots = torch.arange(longest, device=lengths.device)
    return (lengths[:, None] - 1 - slots[None, :]).clamp(min=0)


class MaskedItemModel(nn.Module):
    """BERT4Rec-style: predicts masked items of a sequence from the items around them.

    Args:
        config: sizes, dropout and the item table's kind (``compressed``) and policy.
        num_items: items (the mask token is id ``num_items``).
        device: where to build.

    Example::

        >>> cfg = SeqModelConfig(embedding_dim=16, num_heads=2, d_ff=32, max_len=8, compressed=False)
        >>> model = MaskedItemModel(cfg, num_items=100)
        >>> kjt = item_kjt(torch.tensor([3, 4, 100, 7, 100]), torch.tensor([3, 2]))
        >>> model(kjt, torch.tensor([False, False, True, False, True])).shape
        torch.Size([2, 100])
    """

    def __init__(self, config: SeqModelConfig, num_items: int, device: Optional[torch.device | str] = None) -> None:
        super().__init__()
        if num_items < 2:
            raise ValueError(f"MaskedItemModel: need at least 2 items, got {num_items}")
        self.config = config
        self.num_items = num_items
        self.mask_id = num_items
        d = config.embedding_dim
        tables = [
            EmbeddingConfig(
                name=ITEM_TABLE, embedding_dim=d, num_embeddings=num_items + 1, feature_names=[ITEM_FEATURE]
            )
        ]
        self.items: nn.Module
        if config.compressed:
            self.items = TTMEmbeddingCollection(
                tables, config.policy(), device=device, validate_inputs=config.validate_inputs
            )
        else:
            self.items = EmbeddingCollection(tables, device=device)
            with torch.no_grad():  # BERT-style small init; TorchRec's default is uniform(-1/sqrt(n), ...)
                self.items.embeddings[ITEM_TABLE].weight.normal_(0.0, 0.02)
        self.positions = nn.Embedding(config.max_len, d, device=device)
        nn.init.normal_(self.positions.weight, 0.0, 0.02)
        self.input_norm = nn.LayerNorm(d, device=device)
        self.dropout = nn.Dropout(config.dropout)
        layer = nn.TransformerEncoderLayer(
            d,
            config.num_heads,
            config.d_ff,
            config.dropout,
            activation="gelu",
            batch_first=True,
            norm_first=config.pre_norm,
            device=device,
        )
        # pre-LN blocks leave their sum unnormalised: one LayerNorm after the last
        final_norm = nn.LayerNorm(d, device=device) if config.pre_norm else None
        # nested tensors would skip padded positions only in eval, changing numerics between modes
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, norm=final_norm, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(d, d, device=device), nn.GELU(), nn.LayerNorm(d, device=device))
        self.bias = nn.Parameter(torch.zeros(num_items, device=device))

    def item_table(self) -> torch.Tensor:
        """``(num_items, D)`` item rows (without the mask token), differentiable; a TTM
        table is reconstructed whole, which suits catalogues of up to ~10^5 items."""
        if isinstance(self.items, TTMEmbeddingCollection):
            weight = self.items.table_weight(ITEM_TABLE)
        else:
            weight = self.items.embeddings[ITEM_TABLE].weight
        return weight[: self.num_items]

    def encode(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``(B, L, D)`` encoder states of the padded sequences (L: the longest, <= max_len)."""
        jt = self.items(features)[ITEM_FEATURE]
        lengths = jt.lengths().long()
        longest = int(lengths.max()) if lengths.numel() else 0
        if longest > self.config.max_len:
            raise ValueError(
                f"MaskedItemModel: a sequence of {longest} items exceeds model.max_len={self.config.max_len}"
            )
        x = jagged_to_padded(jt.values(), lengths, longest)
        # positions count back from each sequence's last item: the item evaluation predicts
        # (a mask after the history) is always position 0, which training masks most often
        # (mask_last_prob), while counted from the front it would sit past every trained position
        x = x + self.positions(from_end_positions(lengths, longest))
        x = self.dropout(self.input_norm(x))
        padding = torch.arange(longest, device=x.device)[None, :] >= lengths[:, None]
        return self.encoder(x, src_key_padding_mask=padding)

    def forward(self, features: KeyedJaggedTensor, picked: torch.Tensor) -> torch.Tensor:
        """Scores of every item at the picked positions.

        Args:
            features: the (masked) sequences, KJT key ``"items"``.
            picked: ``(N,)`` bool, one per id of ``features``: the positions to score.

        Returns:
            ``(M, num_items)`` scores (logits), M = picked positions, in sequence order.
        """
        states = self.encode(features)
        lengths = features.lengths().long()
        valid = torch.arange(states.shape[1], device=states.device)[None, :] < lengths[:, None]
        hidden = states[valid][picked]  # (M, D): the valid positions in order are the jagged values
        return self.head(hidden) @ self.item_table().t() + self.bias
