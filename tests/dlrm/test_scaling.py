"""comera_rec.dlrm.scaling: the counts of what a step sends, against hand counts on tiny shapes."""

from __future__ import annotations

import math

import pytest

from comera_rec.dlrm.config import DLRMConfig
from comera_rec.dlrm.scaling import ModelComm, Network, allreduce_time, alltoall_time, count_config, step_bytes

# 2 tables (1000 and 50 rows) of dim 8, 13 dense inputs, bottom 13-16-8, dot interaction of 3
# vectors (8 + 3 pairs = 11 inputs to the top), top 11-16-1
TINY = dict(table_sizes=[1000, 50], embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1])
MLP = (13 * 16 + 16) + (16 * 8 + 8) + (11 * 16 + 16) + (16 * 1 + 1)


def test_dense_model_counts_by_hand() -> None:
    c = count_config(DLRMConfig(**TINY, compressed=False))
    assert (c.replicated_params, c.tt_table_params, c.mlp_params) == (MLP, 0, MLP)
    assert (c.sharded_features, c.sharded_table_params, c.embedding_dim) == (2, 1050 * 8, 8)


def test_compressed_table_is_replicated_not_sharded() -> None:
    cfg = DLRMConfig(**TINY, rank=2, min_rows_to_compress=100, min_params_to_compress=0, min_gain=0.0)
    c = count_config(cfg)
    assert (c.sharded_features, c.sharded_table_params) == (1, 50 * 8)  # the 50-row table stays dense
    assert c.tt_table_params > 0 and c.replicated_params == c.tt_table_params + c.mlp_params


def test_step_bytes_by_hand() -> None:
    c = ModelComm(
        "x", replicated_params=1000, tt_table_params=0, sharded_features=3, sharded_table_params=0, embedding_dim=4
    )
    s = step_bytes(c, world=4, batch_per_rank=10)
    assert s.allreduce == 2 * 3 / 4 * 4000  # ring: 2 (N-1)/N of 1000 floats
    assert s.alltoall_pooled == 2 * 3 / 4 * (10 * 3 * 4 * 4)  # fwd + bwd, batch x features x dim x 4 B
    assert s.alltoall_ids == 3 / 4 * (10 * 3 * (8 + 4))  # int64 ids + int32 lengths
    assert s.total == s.allreduce + s.alltoall_pooled + s.alltoall_ids
    one = step_bytes(c, world=1, batch_per_rank=10)
    assert one.total == 0.0
    with pytest.raises(ValueError):
        step_bytes(c, world=0, batch_per_rank=10)


def test_network_model_by_hand() -> None:
    net = Network(
        gpus_per_node=2, intra_GBps=100.0, inter_GBps=10.0, intra_latency_us=0, inter_latency_us=0, per_peer_us=0
    )
    assert allreduce_time(1e9, 2, net) == pytest.approx(2 * 0.5 * 1e9 / 100e9)
    # 2 nodes of 2: in-node reduce-scatter + all-gather, then a ring over 2 nodes on half the bytes
    assert allreduce_time(1e9, 4, net) == pytest.approx(0.01 + 2 * 0.5 * 0.5e9 / 10e9)
    # all-to-all over 4: a quarter to the node's peer over NVLink, half to the other node over the NIC
    assert alltoall_time(1e9, 4, net) == pytest.approx(max(0.25e9 / 100e9, 0.5e9 / 10e9))
    assert allreduce_time(1e9, 1, net) == alltoall_time(1e9, 1, net) == 0.0
    assert math.isfinite(allreduce_time(1e9, 512, Network()))
