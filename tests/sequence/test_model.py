"""The masked-item model: output shapes for both item-table kinds, the jagged-to-padded
layout, padding independence, and the TT table through the compression policy."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingCollection

from comera_rec.integration.embedding_collection import TTMEmbeddingCollection
from comera_rec.sequence.config import SeqModelConfig
from comera_rec.sequence.model import MaskedItemModel, from_end_positions, item_kjt, jagged_to_padded


def small(compressed: bool) -> SeqModelConfig:
    return SeqModelConfig(
        compressed=compressed, embedding_dim=16, num_layers=1, num_heads=2, d_ff=32, max_len=8, rank=4, dropout=0.0
    )


@pytest.mark.parametrize("compressed", [False, True])
def test_forward_shapes_and_gradients(compressed: bool) -> None:
    torch.manual_seed(0)
    model = MaskedItemModel(small(compressed), num_items=200)
    assert isinstance(model.items, TTMEmbeddingCollection if compressed else EmbeddingCollection)
    if compressed:
        assert model.items.compressed_tables() == ["item"]
    values = torch.tensor([3, 4, 200, 7, 200, 1, 2, 3, 4, 5, 6, 7, 200])
    lengths = torch.tensor([3, 2, 0, 8])
    picked = values == 200
    scores = model(item_kjt(values, lengths), picked)
    assert scores.shape == (3, 200)
    assert model.encode(item_kjt(values, lengths)).shape == (4, 8, 16)
    scores.logsumexp(1).sum().backward()
    grads = [p.grad for p in model.items.parameters()]
    assert grads and all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def test_rows_do_not_see_each_other() -> None:
    """A row's scores do not depend on the other rows of its batch (padding is masked)."""
    torch.manual_seed(1)
    model = MaskedItemModel(small(True), num_items=50).eval()
    alone = model(item_kjt(torch.tensor([5, 6, 50]), torch.tensor([3])), torch.tensor([False, False, True]))
    values = torch.tensor([5, 6, 50, 1, 2, 3, 4, 5, 6, 7, 50])
    batch = model(item_kjt(values, torch.tensor([3, 8])), values == 50)
    torch.testing.assert_close(batch[0], alone[0], rtol=1e-5, atol=1e-5)


def test_jagged_to_padded() -> None:
    values = torch.arange(10.0).reshape(5, 2)
    out = jagged_to_padded(values, torch.tensor([2, 0, 3]), 4)
    assert out.shape == (3, 4, 2)
    assert out[0, :2].tolist() == [[0, 1], [2, 3]] and out[2, :3].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert float(out[1].abs().sum()) == 0.0 and float(out[0, 2:].abs().sum()) == 0.0


def test_tt_table_is_smaller_and_too_long_fails() -> None:
    dense = MaskedItemModel(small(False), num_items=5000)
    tt = MaskedItemModel(small(True), num_items=5000)

    def table_bytes(m: MaskedItemModel) -> int:
        return sum(p.numel() * p.element_size() for p in m.items.parameters())

    assert table_bytes(tt) * 10 < table_bytes(dense)
    with pytest.raises(ValueError, match="exceeds model.max_len=8"):
        tt(item_kjt(torch.arange(9), torch.tensor([9])), torch.ones(9, dtype=torch.bool))
    with pytest.raises(ValueError, match="items"):  # an id past the table: the collection names feature and value
        tt(item_kjt(torch.tensor([1, 99999]), torch.tensor([2])), torch.tensor([False, True]))


def test_positions_count_back_from_the_last_item() -> None:
    """Every row's last slot (where evaluation puts the mask) reads position 0, whatever
    its length: the slot training masks with mask_last_prob. Counted from the front, the
    mask of a long history sat past every position training had used."""
    assert from_end_positions(torch.tensor([3, 1, 0]), 3).tolist() == [[2, 1, 0], [0, 0, 0], [0, 0, 0]]
    model = MaskedItemModel(small(False), num_items=50).eval()
    seen = []
    model.positions.register_forward_hook(lambda _m, args, _out: seen.append(args[0].clone()))
    values = torch.tensor([1, 2, 3, 50, 7, 50])
    model(item_kjt(values, torch.tensor([4, 2])), values == 50)
    assert seen[0].tolist() == [[3, 2, 1, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize("pre_norm", [False, True])
def test_pre_norm_blocks(pre_norm: bool) -> None:
    model = MaskedItemModel(replace(small(False), pre_norm=pre_norm), num_items=50)
    assert all(layer.norm_first == pre_norm for layer in model.encoder.layers)
    assert (model.encoder.norm is not None) == pre_norm  # pre-LN sums end in one more LayerNorm
    values = torch.tensor([1, 2, 50])
    model(item_kjt(values, torch.tensor([3])), values == 50).logsumexp(1).sum().backward()
    assert all(p.grad is not None for p in model.encoder.parameters())
