"""What the two TTM collections share (comera_rec/integration/table_groups.py): the table
names' check, the plans, and the stacking of the compressed tables by TT shape."""

from __future__ import annotations

import pytest
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig

from comera_rec.integration import TTMEmbeddingBagCollection, TTMEmbeddingCollection
from comera_rec.integration.table_groups import distinct_table_names
from tests.integration.helpers import policy, tables


def test_distinct_table_names_in_order_or_an_error_naming_the_owner() -> None:
    assert distinct_table_names("Owner", tables()) == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match=r"^Owner: duplicate table names \['a', 'c'\]"):
        distinct_table_names("Owner", tables() + [tables()[0], tables()[2]])


def test_tables_stacked_by_shape_in_config_order() -> None:
    ebc = TTMEmbeddingBagCollection(tables(), policy())
    # a and b share a TT shape (the policy's override), d has one of its own, c stays dense
    assert ebc.compressed_tables() == ["a", "b", "d"] and ebc.dense_tables() == ["c"]
    assert [g.num_tables for g in ebc.groups] == [2, 1]
    assert [g.num_embeddings for g in ebc.groups] == [[100, 90], [300]]
    assert sorted(ebc.plans) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("kind", ["bag", "sequence"])
def test_a_table_without_features_reads_its_own_name(kind: str) -> None:
    config = EmbeddingBagConfig if kind == "bag" else EmbeddingConfig
    made = [config(name="t", embedding_dim=8, num_embeddings=100), config(name="u", embedding_dim=8, num_embeddings=90)]
    collection = (TTMEmbeddingBagCollection if kind == "bag" else TTMEmbeddingCollection)(made, policy())
    assert [t.feature_names for t in made] == [["t"], ["u"]]
    assert set(collection.plans) == {"t", "u"}


@pytest.mark.parametrize("kind", ["bag", "sequence"])
def test_a_compressed_table_not_fp32_is_an_error_naming_the_collection(kind: str) -> None:
    config = EmbeddingBagConfig if kind == "bag" else EmbeddingConfig
    owner = TTMEmbeddingBagCollection if kind == "bag" else TTMEmbeddingCollection
    made = [config(name="a", embedding_dim=8, num_embeddings=100, feature_names=["f"], data_type=DataType.FP16)]
    with pytest.raises(ValueError, match=rf"^{owner.__name__}: compressed table 'a' must be FP32"):
        owner(made, policy())
