"""Synthetic generator: determinism, rank streams, Zipf law, round trips, learnable signal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from comera_rec.data.readers import CriteoParquetReader, CriteoReaderConfig, CriteoTsvReader
from comera_rec.data.synthetic import SyntheticCriteo, SyntheticCriteoConfig, ZipfSampler, expected_auc, roc_auc

SMALL = [
    3,
    10,
    100,
    1000,
    50,
    7,
    2000,
    400,
    2,
    5000,
    60,
    300,
    20,
    4,
    900,
    100,
    9,
    250,
    30,
    1,
    700,
    12,
    15,
    800,
    40,
    150,
]


def _cfg(**kw) -> SyntheticCriteoConfig:
    base = dict(num_embeddings_per_feature=SMALL, batch_size=256, num_rows=2000, block_rows=512, seed=3)
    base.update(kw)
    return SyntheticCriteoConfig(**base)


def test_deterministic_by_seed(collect_batches):
    a = collect_batches(SyntheticCriteo(_cfg()))
    b = collect_batches(SyntheticCriteo(_cfg()))
    c = collect_batches(SyntheticCriteo(_cfg(seed=4)))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[2], c[2])
    assert a[0].shape == (2000,) and (a[2] < np.array(SMALL)[None, :]).all() and (a[2] >= 0).all()


def test_ranks_get_disjoint_parts_of_the_same_data(collect_batches):
    whole = collect_batches(SyntheticCriteo(_cfg()))
    parts = [collect_batches(SyntheticCriteo(_cfg(rank=r, world_size=3))) for r in range(3)]
    assert sum(len(p[0]) for p in parts) == 2000
    key = lambda t: sorted(map(tuple, np.concatenate([t[1], t[2].astype(np.float32)], 1).tolist()))  # noqa: E731
    merged = tuple(np.concatenate([p[k] for p in parts]) for k in range(3))
    assert key(merged) == key(whole)
    assert not np.array_equal(parts[0][2][:100], parts[1][2][:100])


def test_val_stream_fixed_and_distinct_from_train(collect_batches):
    gen = SyntheticCriteo(_cfg(stream="val"))
    gen.set_epoch(5)  # ignored by the val stream
    v1, v2 = collect_batches(gen), collect_batches(SyntheticCriteo(_cfg(stream="val")))
    np.testing.assert_array_equal(v1[2], v2[2])
    assert not np.array_equal(v1[2], collect_batches(SyntheticCriteo(_cfg()))[2])
    train = SyntheticCriteo(_cfg())
    e0 = collect_batches(train)
    train.set_epoch(1)
    assert not np.array_equal(e0[2], collect_batches(train)[2])


def test_drop_last_equal_counts():
    counts = [
        sum(1 for _ in SyntheticCriteo(_cfg(rank=r, world_size=3, drop_last=True, batch_size=100))) for r in range(3)
    ]
    assert len(set(counts)) == 1 and counts[0] > 0


@pytest.mark.parametrize("n,s", [(5000, 1.1), (200_000, 1.0), (10_000_000, 1.3), (7, 0.8)])
def test_zipf_sampler_matches_law(n, s):
    sampler = ZipfSampler(n, s, head=256)
    r = sampler.sample(np.random.default_rng(0), 400_000)
    assert r.min() >= 0 and r.max() < n
    k = np.arange(1, n + 1, dtype=np.float64) if n <= 200_000 else None
    if k is not None:
        p = k**-s / (k**-s).sum()
        # head ranks exactly, and the mass of rank bands in the tail
        emp = np.bincount(r, minlength=n) / len(r)
        assert (np.abs(emp[:5] - p[:5]) <= 5 * np.sqrt(p[:5] / len(r))).all(), (emp[:5], p[:5])
        for a, b in [(256, 1000), (1000, n)]:
            if b <= n:
                assert abs(emp[a:b].sum() - p[a:b].sum()) < 0.01
    else:
        # 10M ranks: fraction above the head follows the continuous tail law
        assert abs((r >= 256).mean() - sampler.tail_mass / sampler.total) < 0.005


def test_tsv_and_parquet_round_trip(tmp_path, collect_batches):
    gen = SyntheticCriteo(_cfg(num_rows=1500))
    stream = collect_batches(gen)
    for name in ("synth.tsv", "synth.tsv.gz"):
        gen.write_tsv(tmp_path / name, 1500)
        got = collect_batches(
            CriteoTsvReader(
                CriteoReaderConfig(
                    paths=[str(tmp_path / name)], batch_size=256, num_embeddings_per_feature=SMALL, bad_input="strict"
                )
            )
        )
        for x, y in zip(got, stream):
            np.testing.assert_allclose(x, y, rtol=1e-6)
    gen.write_parquet(tmp_path / "synth.parquet", 1500)
    got = collect_batches(
        CriteoParquetReader(CriteoReaderConfig(paths=[str(tmp_path / "synth.parquet")], batch_size=256))
    )
    for x, y in zip(got, stream):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_auc_helpers():
    rng = np.random.default_rng(0)
    s, y = rng.random(500), rng.random(500) < 0.3
    pairs = (s[y][:, None] > s[~y][None, :]).mean()
    assert abs(roc_auc(s, y) - pairs) < 1e-12
    p = rng.random(20_000)
    labels = rng.random(20_000) < p
    assert abs(expected_auc(p) - roc_auc(p, labels)) < 0.02


def test_signal_is_learnable(collect_batches):
    """Logistic regression on dense + one-hot ids of the synthetic stream beats AUC 0.5 clearly."""
    torch.manual_seed(0)
    cfg = _cfg(num_rows=40_000, batch_size=1000, block_rows=4096)
    gen = SyntheticCriteo(cfg)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(SMALL)[:-1]]))
    emb = torch.nn.EmbeddingBag(sum(SMALL), 1, mode="sum")
    torch.nn.init.zeros_(emb.weight)
    lin = torch.nn.Linear(13, 1)
    opt = torch.optim.Adam(list(emb.parameters()) + list(lin.parameters()), lr=0.05)

    def logits(b):
        ids = b.sparse_features.values().view(26, -1).T + offsets  # [B, 26] global one-hot index
        return (lin(b.dense_features) + emb(ids)).squeeze(1)

    for _ in range(3):
        for b in gen:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(b), b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    val = SyntheticCriteo(_cfg(num_rows=10_000, batch_size=2000, stream="val"))
    with torch.no_grad():
        scores, labels = zip(*[(logits(b).numpy(), b.labels.numpy()) for b in val])
    auc = roc_auc(np.concatenate(scores), np.concatenate(labels))
    bayes = gen.bayes_auc(rows=20_000)
    assert auc > 0.7, auc
    assert bayes > auc - 0.02 and bayes < 0.95, (bayes, auc)
