"""The sequence lookup benchmark's pieces: the Zipf ids, the TT child's measurements (in
this process, small), and the markdown table's ratios. The FBGEMM child (DMP in a gloo
group of its own) runs in ``python launch/bench_seq_lookup.py --quick``."""

from __future__ import annotations

import torch

from comera_rec.sequence.bench import LookupSetup, child, table, zipf_ids


def test_zipf_ids() -> None:
    setup = LookupSetup(num_items=1000, batch_size=4)
    ids = zipf_ids(setup, 50, 0)
    assert ids.shape == (200,) and int(ids.min()) >= 0 and int(ids.max()) < 1000
    assert torch.equal(ids, zipf_ids(setup, 50, 0)) and not torch.equal(ids, zipf_ids(setup, 50, 1))
    counts = torch.bincount(torch.cat([zipf_ids(setup, 50, s) for s in range(20)]), minlength=1000)
    assert int(counts.max()) > 10 * float(counts.float().mean())  # a popular head


def test_tt_child_measures() -> None:
    setup = LookupSetup(
        num_items=5000, embedding_dim=16, batch_size=4, seq_lens=[10], rank=4, warmup_steps=1, timed_steps=2
    )
    r = child("tt", setup)
    assert r["variant"] == "tt" and r["step_s"]["10"] > 0 and r["peak_rss"] > 0
    assert (
        0 < r["table_bytes"] < 5000 * 16 * 4 and r["state_bytes"] >= 2 * r["table_bytes"]
    )  # AdamW: two moments (and step counts)


def test_table_ratios() -> None:
    setup = LookupSetup(seq_lens=[50])
    base = {"step_s": {"50": 0.01}, "table_bytes": 1000, "state_bytes": 10, "peak_rss": 2**30}
    tt = {"step_s": {"50": 0.02}, "table_bytes": 10, "state_bytes": 20, "peak_rss": 2**29}
    text = table({"fbgemm": base, "tt": tt}, setup)
    assert "| tt | 20.00 (2.00x) | 0.0 MB (100x smaller) |" in text and "(0.50x)" in text
