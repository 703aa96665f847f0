"""The sequence data: the synthetic generator (determinism, its known best hit rate checked
against the dense transition matrix and by simulation), the leave-one-out split, the
batches, the interaction-file reader (CSV, TSV without header, Parquet, bad lines), and the
clustered chain (groups sharing successors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from comera_rec.sequence.config import SeqDataConfig
from comera_rec.sequence.data import (
    MarkovChain,
    Sequences,
    evaluation_batches,
    leave_one_out,
    markov_sessions,
    read_interactions,
    training_batches,
)
from comera_rec.sequence.metrics import RankingMetrics
from comera_rec.sequence.task import load_splits


def test_generator_is_deterministic_and_seeded() -> None:
    a, chain_a = markov_sessions(300, 80, seed=3)
    b, chain_b = markov_sessions(300, 80, seed=3)
    c, _ = markov_sessions(300, 80, seed=4)
    assert np.array_equal(a.values, b.values) and np.array_equal(a.offsets, b.offsets)
    assert np.array_equal(chain_a.successors, chain_b.successors)
    assert not np.array_equal(a.values[:50], c.values[:50])
    lengths = a.lengths()
    assert lengths.min() >= 10 and lengths.max() <= 30 and a.values.max() < 80


def test_sessions_follow_the_chain() -> None:
    """Empirical transition frequencies match the chain's probabilities."""
    seqs, chain = markov_sessions(4000, 20, min_length=20, max_length=20, noise=0.2, seed=0)
    prev = np.concatenate([seqs[i][:-1] for i in range(len(seqs))])
    nxt = np.concatenate([seqs[i][1:] for i in range(len(seqs))])
    counts = np.zeros((20, 20))
    np.add.at(counts, (prev, nxt), 1)
    empirical = counts / counts.sum(1, keepdims=True)
    expected = chain.probabilities(torch.arange(20)).numpy()
    assert np.abs(empirical - expected).max() < 0.03


def test_clustered_chain_shares_successors_within_hidden_groups() -> None:
    """Items of a group have the group's successors, groups are about equal and spread over
    the ids (not ranges), the next-item matrix has rank <= groups + 1 (the groups' rows plus
    the noise floor), and sessions drawn from it follow it."""
    chain = MarkovChain.clustered(60, branching=4, noise=0.1, clusters=6, seed=2)
    rows, group_of_item = np.unique(chain.successors, axis=0, return_inverse=True)
    assert len(rows) == 6 and sorted(np.bincount(group_of_item.ravel()).tolist()) == [10] * 6
    assert all(len(set(r.tolist())) == 4 for r in rows)
    assert any(len(set(group_of_item.ravel()[g * 10 : g * 10 + 10].tolist())) > 1 for g in range(6))
    probs = chain.probabilities(torch.arange(60))
    assert int(torch.linalg.matrix_rank(probs)) <= 7
    assert chain.best_hit_rate(10) == pytest.approx(float(probs.topk(10, dim=1).values.sum(1).mean()), abs=1e-12)

    seqs, drawn = markov_sessions(3000, 30, min_length=20, max_length=20, noise=0.2, clusters=3, seed=0)
    assert len(np.unique(drawn.successors, axis=0)) == 3
    prev = np.concatenate([seqs[i][:-1] for i in range(len(seqs))])
    nxt = np.concatenate([seqs[i][1:] for i in range(len(seqs))])
    counts = np.zeros((30, 30))
    np.add.at(counts, (prev, nxt), 1)
    empirical = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    assert np.abs(empirical - drawn.probabilities(torch.arange(30)).numpy()).max() < 0.05
    with pytest.raises(ValueError, match="clusters=0"):
        MarkovChain.clustered(60, branching=4, noise=0.1, clusters=0, seed=0)
    for bad in (-1, 61, True):
        with pytest.raises(ValueError, match="SeqDataConfig.clusters"):
            SeqDataConfig(num_items=60, clusters=bad)
    # the run's data: the config's groups reach the chain the splits come from
    _, run_chain = load_splits(SeqDataConfig(num_users=50, num_items=60, clusters=6))
    assert len(np.unique(run_chain.successors, axis=0)) == 6


@pytest.mark.parametrize("k", [1, 3, 10])
def test_best_hit_rate_exact_and_simulated(k: int) -> None:
    """The closed-form best hit rate / NDCG equal (a) the top-k sums of the dense
    transition matrix and (b) torchmetrics on the chain's scores of sampled next items."""
    chain = MarkovChain.random(60, branching=4, noise=0.1, seed=1)
    probs = chain.probabilities(torch.arange(60))  # (V, V)
    top = probs.topk(k, dim=1).values
    assert chain.best_hit_rate(k) == pytest.approx(float(top.sum(1).mean()), abs=1e-12)
    discounts = 1.0 / torch.log2(torch.arange(k, dtype=torch.float64) + 2)
    assert chain.best_ndcg(k) == pytest.approx(float((top * discounts).sum(1).mean()), abs=1e-12)

    # simulation: next items drawn from the chain, ranked by the chain's own probabilities
    # (RankingMetrics, which test_metrics.py checks against torchmetrics); the noise floor's
    # ties are broken by a tiny random jitter (any order among equals is optimal)
    g = torch.Generator().manual_seed(0)
    n = 50000
    prev = torch.randint(0, 60, (n,), generator=g)
    scores = chain.probabilities(prev)
    nxt = torch.multinomial(scores, 1, generator=g).squeeze(1)
    scores = scores + 1e-9 * torch.rand(scores.shape, generator=g, dtype=torch.float64)
    metrics = RankingMetrics([k])
    metrics.update(scores, nxt)
    result = metrics.compute()
    se = (chain.best_hit_rate(k) * (1 - chain.best_hit_rate(k)) / n) ** 0.5
    assert result[f"hit_rate_{k}"] == pytest.approx(chain.best_hit_rate(k), abs=5 * se + 1e-9)
    assert result[f"ndcg_{k}"] == pytest.approx(chain.best_ndcg(k), abs=5 * se + 1e-9)


def test_leave_one_out_and_batches() -> None:
    seqs = Sequences.from_lists([[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 0, 1]])
    sp = leave_one_out(seqs, num_items=10)
    assert [sp.train[i].tolist() for i in range(3)] == [[0, 1, 2], [5], [8, 9]]
    assert sp.val.targets.tolist() == [3, 6, 0] and sp.test.targets.tolist() == [4, 7, 1]
    assert [sp.test[i].tolist() for i in range(3)] == [[0, 1, 2, 3], [5, 6], [8, 9, 0]]
    with pytest.raises(ValueError, match="3 items"):
        leave_one_out(Sequences.from_lists([[1, 2]]), 3)

    ev = list(evaluation_batches(sp.test, 2, max_len=3, mask_id=10))
    assert ev[0]["values"].tolist() == [2, 3, 10, 5, 6, 10]  # last max_len - 1 items, then the mask
    assert ev[0]["lengths"].tolist() == [3, 3] and ev[0]["labels"].tolist() == [4, 7]
    assert ev[0]["values"][ev[0]["picked"]].tolist() == [10, 10] and len(ev) == 2

    long = Sequences.from_lists([list(range(i, i + 12)) for i in range(40)])
    kw = dict(mask_prob=0.3, mask_last_prob=0.5, seed=5)
    first = list(training_batches(long, 8, 10, 99, **kw))
    again = list(training_batches(long, 8, 10, 99, **kw))
    assert len(first) == 5 and all(torch.equal(a["values"], b["values"]) for a, b in zip(first, again))
    for b in first:
        assert b["lengths"].tolist() == [10] * 8  # cut to the last max_len items
        assert bool((b["values"][b["picked"]] == 99).all()) and b["labels"].numel() == int(b["picked"].sum())
        per_row = b["picked"].view(8, 10).sum(1)
        assert bool((per_row >= 1).all())  # every row predicts something
        restored = b["values"].clone()
        restored[b["picked"]] = b["labels"]
        starts = restored.view(8, 10)[:, 0]
        assert torch.equal(restored.view(8, 10), starts[:, None] + torch.arange(10))  # the true items


# ----------------------------------------------------------------------------- reader


def test_reader_sorts_by_time_and_remaps(tmp_path) -> None:
    path = tmp_path / "ratings.csv"
    path.write_text(
        "userId,movieId,rating,timestamp\n"
        "2,50,4.0,300\n"
        "1,30,3.5,200\n"
        "1,10,5.0,100\n"
        "2,10,1.0,100\n"
        "1,20,2.0,300\n"
        "2,40,3.0,200\n"
        "3,10,3.0,1\n"  # only two interactions: dropped
        "3,20,3.0,2\n"
        "1,50,1.0,300\n"  # same time as 1,20: file order kept
    )
    data = read_interactions(path)
    assert data.user_ids.tolist() == [1, 2] and data.dropped_users == 1
    assert data.item_ids.tolist() == [10, 20, 30, 40, 50]
    assert data.sequences[0].tolist() == [0, 2, 1, 4] and data.sequences[1].tolist() == [0, 3, 4]

    tsv = tmp_path / "u.data"  # ml-100k: tab-separated, no header
    tsv.write_text("".join(f"{u}\t{i}\t3\t{t}\n" for u, i, t in [(7, 100, 3), (7, 200, 1), (7, 300, 2)]))
    d2 = read_interactions(tsv, header=False, columns=["user", "item", "rating", "ts"], user_column="user",
                           item_column="item", time_column="ts")  # fmt: skip
    assert d2.sequences[0].tolist() == [1, 2, 0]

    dat = tmp_path / "ratings.dat"  # ml-1m: "::"
    dat.write_text("1::5::3::10\n1::6::3::5\n1::7::3::20\n")
    d3 = read_interactions(dat, header=False, columns=["userId", "movieId", "rating", "timestamp"])
    assert d3.sequences[0].tolist() == [1, 0, 2]


def test_reader_parquet(tmp_path) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    frame = pd.DataFrame({"userId": [1, 1, 1, 2, 2, 2], "movieId": [9, 8, 7, 7, 8, 9], "timestamp": [3, 2, 1, 1, 3, 2]})
    frame.to_parquet(tmp_path / "r.parquet")
    data = read_interactions(tmp_path / "r.parquet")
    assert data.sequences[0].tolist() == [0, 1, 2] and data.sequences[1].tolist() == [0, 2, 1]


@pytest.mark.parametrize(
    "line, message",
    [
        ("1,abc,3.0,5", r"line 3: column 'movieId': 'abc' is not an integer"),
        ("1,10", r"line 3: column 'timestamp': empty"),
        ("1,10,3.0,5,extra,more", r"malformed line.*line 3"),
    ],
)
def test_reader_names_file_and_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(f"userId,movieId,rating,timestamp\n1,10,3.0,1\n{line}\n1,11,2.0,7\n")
    with pytest.raises(ValueError, match=message) as info:
        read_interactions(path)
    assert "bad.csv" in str(info.value)


def test_reader_missing_column(tmp_path) -> None:
    path = tmp_path / "r.csv"
    path.write_text("user,item,time\n1,2,3\n")
    with pytest.raises(ValueError, match=r"no column\(s\) \['userId', 'movieId', 'timestamp'\]"):
        read_interactions(path)
