"""Metrics against references computed another way: a numpy rank-sum AUC, torchmetrics'
BinaryAUROC, one process against two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from hypothesis import given, settings
from hypothesis import strategies as st
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC

from comera_rec.integration import destroy_distributed
from comera_rec.training import BinaryMetrics
from comera_rec.training.metrics import binary_auroc


def rank_sum_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney U / (n_pos n_neg) with average ranks for ties."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_metrics_match_reference():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=1000)
    logits = rng.normal(size=1000) + labels * 0.8
    logits[:50] = np.round(logits[:50])  # some ties
    m = BinaryMetrics()
    for chunk in np.array_split(np.arange(1000), 7):
        m.update(torch.tensor(logits[chunk], dtype=torch.float32), torch.tensor(labels[chunk]))
    out = m.compute()
    p = 1 / (1 + np.exp(-logits))
    ref_loss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    assert out["count"] == 1000
    assert out["auc"] == pytest.approx(rank_sum_auc(logits.astype(np.float32), labels), abs=1e-5)
    assert out["accuracy"] == pytest.approx(np.mean((p > 0.5) == labels), abs=1e-6)
    assert out["log_loss"] == pytest.approx(ref_loss, rel=1e-5)
    m.reset()
    m.update(torch.tensor([3.0, -3.0]), torch.tensor([1, 0]))
    assert m.compute()["auc"] == 1.0 and m.compute()["count"] == 2


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 logits for 2 labels"):
        BinaryMetrics().update(torch.zeros(3), torch.zeros(2))


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(2, 200),
    distinct=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_auc_and_accuracy_match_torchmetrics(size: int, distinct: int, seed: int) -> None:
    """On probabilities with many ties (``distinct`` values), as torchmetrics computes
    them; both classes present."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (size,), generator=g)
    labels[:2] = torch.tensor([0, 1])
    probs = torch.randint(0, distinct, (size,), generator=g).float() / distinct + 0.5 / distinct
    logits = torch.logit(probs)
    m = BinaryMetrics()
    m.update(logits, labels)
    out = m.compute()
    assert out["auc"] == pytest.approx(float(BinaryAUROC()(probs, labels)), abs=1e-6)
    assert out["accuracy"] == pytest.approx(float(BinaryAccuracy()(probs, labels)), abs=1e-6)
    assert binary_auroc(probs, labels) == pytest.approx(out["auc"], abs=1e-12)  # any monotone score


def test_one_class_or_nothing_gives_nan() -> None:
    m = BinaryMetrics()
    assert np.isnan(m.compute()["auc"]) and m.compute()["count"] == 0
    m.update(torch.tensor([0.3, -2.0]), torch.tensor([1.0, 1.0]))
    out = m.compute()
    assert np.isnan(out["auc"]) and out["accuracy"] == 0.5 and out["count"] == 2


def test_a_label_not_zero_or_one_is_an_error() -> None:
    with pytest.raises(ValueError, match="labels must be 0 or 1, got 2"):
        BinaryMetrics().update(torch.zeros(3), torch.tensor([0, 2, 1]))


def test_the_logits_are_copied() -> None:
    """An update keeps its own copy: a caller reusing its output buffer changes nothing."""
    logits, labels = torch.tensor([1.0, -1.0]), torch.tensor([1, 0])
    m = BinaryMetrics()
    m.update(logits, labels)
    logits.neg_()
    assert m.compute()["auc"] == 1.0


def _two_process_worker(rank: int, init: str, logits: torch.Tensor, labels: torch.Tensor, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        m = BinaryMetrics()
        mine = slice(0, 300) if rank == 0 else slice(300, None)  # uneven shards
        for chunk in torch.arange(len(logits))[mine].split(64):
            m.update(logits[chunk], labels[chunk])
        torch.save(m.compute(), f"{out}.{rank}")
    finally:
        destroy_distributed()


def test_two_processes_give_the_metrics_of_all_rows(tmp_path) -> None:
    """Two gloo ranks holding 300 and 170 rows each compute what one process computes on all 470."""
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 2, (470,), generator=g)
    logits = torch.randn(470, generator=g) + 0.7 * labels
    logits[:40] = logits[:40].round()  # ties across the ranks' shards
    out = str(tmp_path / "metrics")
    tmp.spawn(_two_process_worker, args=(f"file://{tmp_path / 'pg'}", logits, labels, out), nprocs=2)
    whole = BinaryMetrics()
    whole.update(logits, labels)
    expected = whole.compute()
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got["count"] == 470
        assert got["auc"] == expected["auc"] and got["accuracy"] == expected["accuracy"]
        assert got["log_loss"] == pytest.approx(expected["log_loss"], rel=1e-6)  # float32 sums in other chunks
    assert expected["auc"] == pytest.approx(rank_sum_auc(logits.numpy(), labels.numpy()), abs=1e-9)
