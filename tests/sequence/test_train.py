"""End to end through the engine's Trainer: the masked-item model beats a random ranking
on the synthetic chain after a few hundred steps, with a dense and with a TT item table;
a MovieLens-style file trains through the reader; the shipped configs load."""

from __future__ import annotations

from pathlib import Path

import pytest

from comera_rec.config import load_config
from comera_rec.sequence.config import SeqRunConfig
from comera_rec.sequence.task import run_seq, train

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "model.dropout=0.0",
    "model.embedding_dim=32",
    "model.num_layers=1",
    "model.d_ff=64",
    "model.max_len=12",
    "model.rank=8",
    "data.num_items=50",
    "data.clusters=0",
    "data.num_users=2000",
    "data.min_length=8",
    "data.max_length=12",
    "data.batch_size=64",
    "data.top_k=[1,5]",
    "trainer.eval_every=0",
    "trainer.log_every=50",
    "trainer.progress=false",
    "trainer.plots=false",
    "trainer.checkpoint_at_end=false",
    "optim.lr_other=0.003",
    "optim.lr_cores=0.003",
    "optim.lr_controllers=0.003",
    "optim.warmup_steps=10",
]


@pytest.mark.parametrize("compressed", [False, True])
def test_beats_random_on_the_chain(tmp_path, compressed: bool) -> None:
    cfg = load_config(
        SeqRunConfig,
        str(ROOT / "configs/seq_synthetic.yaml"),
        [*TINY, f"model.compressed={str(compressed).lower()}", "trainer.max_steps=300", f"trainer.run_dir={tmp_path}"],
    )
    s = run_seq(cfg)
    # random: 1 / 50 and 5 / 50; best: 0.434 and 0.91 (the chain's)
    assert s["random_hit_rate_5"] == pytest.approx(0.1) and s["best_hit_rate_5"] == pytest.approx(0.91)
    assert s["test_hit_rate_5"] > 2 * s["random_hit_rate_5"], s
    assert s["test_hit_rate_1"] > 2 * s["random_hit_rate_1"], s
    assert s["val_hit_rate_5"] > 2 * s["random_hit_rate_5"], s
    assert s["test_hit_rate_5"] < s["best_hit_rate_5"] + 0.05
    assert s["compressed"] is compressed and s["steps"] == 300
    if compressed:
        assert s["item_table_bytes"] < 51 * 32 * 4  # the TT table is smaller than the dense one


def test_trains_on_an_interaction_file(tmp_path, capsys) -> None:
    lines = ["userId,movieId,rating,timestamp"]
    for user in range(40):
        lines += [f"{user},{(user + t) % 30 + 100},4.0,{1000 - t}" for t in range(6)]  # times falling: reversed
    path = tmp_path / "ratings.csv"
    path.write_text("\n".join(lines) + "\n")
    summary = train(
        [
            "--config",
            "seq_movielens",
            f"data.source={path}",
            "data.batch_size=8",
            "data.eval_batch_size=16",
            "model.embedding_dim=16",
            "model.d_ff=32",
            "model.num_layers=1",
            "trainer.max_steps=6",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.progress=false",
            "trainer.plots=false",
        ]
    )
    assert summary["num_items"] == 30 and summary["num_users"] == 40 and summary["steps"] == 6
    assert "test_hit_rate_10" in summary and "best_hit_rate_10" not in summary
    assert "test hit rate" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["seq_synthetic", "seq_movielens"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(SeqRunConfig, str(ROOT / f"configs/{name}.yaml"))
    assert cfg.model.compressed and cfg.trainer.run_dir.startswith("runs/")
