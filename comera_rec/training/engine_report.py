"""The trainer's records: the model's size, the log's truncate and train records and the
end-of-run summary with its files (:class:`TrainerReports`, a mixin of
:class:`~comera_rec.training.engine.Trainer`; the file formats are
:mod:`comera_rec.training.report`'s)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from comera_rec.rank.schedule import ObjectiveTerms, RankSchedule
from comera_rec.rank.size import (
    model_compression_ratio,
    model_live_ranks,
    model_num_bytes,
    model_tt_bytes,
    total_live_rank,
)
from comera_rec.training.dist import world_size
from comera_rec.training.process_state import peak_memory_mb
from comera_rec.training.report import JsonlLog, plot_run, read_jsonl, summary_table
from comera_rec.training.trainer_config import TrainerConfig


class TrainerReports:
    """Mixin of :class:`~comera_rec.training.engine.Trainer`: what it writes about a run.

    It relies on these attributes of the trainer: ``config``, ``run_dir``, ``device``,
    ``schedule``, ``model``, and the counters ``step``, ``samples``, ``nonfinite``,
    ``truncations``, ``losses`` and ``last_eval``.
    """

    config: TrainerConfig
    run_dir: Path
    device: torch.device
    schedule: RankSchedule
    model: Optional[nn.Module]
    step: int
    samples: int
    nonfinite: int
    truncations: int
    losses: list[float]
    last_eval: dict[str, float]

    def _size_record(self) -> dict[str, Any]:
        tau = self.schedule.config.threshold
        return {
            "live_rank": total_live_rank(self.model, tau),
            "tt_bytes": model_tt_bytes(self.model, tau),  # what a rank target counts
            "model_bytes": model_num_bytes(self.model, tau),  # every parameter
            "compression": model_compression_ratio(self.model, tau),
        }

    def _log_truncation(self, log: JsonlLog) -> None:
        """Write the truncate record of the cut this step made."""
        tr = self.schedule.last_truncation
        log.write(
            {
                "kind": "truncate",
                "step": self.step,
                "ranks_before": tr.ranks_before,
                "ranks_after": tr.ranks_after,
                "cuts": len(self.schedule.last_cuts),
                "tt_bytes": model_tt_bytes(self.model, self.schedule.config.threshold),
            }
        )

    def _train_record(self, loss: float, terms: ObjectiveTerms, tput: float) -> dict[str, Any]:
        """The train record of this step.

        Args:
            loss: the mean global task loss of the steps since the last record.
            terms: this step's objective terms.
            tput: samples per second (all processes) since the last record.
        """
        return {
            "kind": "train",
            "step": self.step,
            "loss": loss,
            "objective": float(terms.loss.detach()),
            "surrogate": terms.surrogate,
            "stage": terms.stage,
            "choice": terms.choice,
            "samples_per_s": tput,
            "peak_mem_mb": peak_memory_mb(self.device),
            "nonfinite": self.nonfinite,
            **self._size_record(),
        }

    def _summary(self, throughputs: list[float], wall0: float) -> dict[str, Any]:
        """The run's summary (every process computes it).

        Args:
            throughputs: the samples per second of every train record.
            wall0: ``time.perf_counter()`` when the loop started.
        """
        size = self._size_record()
        summary: dict[str, Any] = {
            "steps": self.step,
            "samples": self.samples,
            "world_size": world_size(),
            "final_train_loss": self.losses[-1] if self.losses else float("nan"),
            # every validation metric the task reports (auc / accuracy / log_loss for DLRM)
            **{f"val_{k}": v for k, v in self.last_eval.items() if k != "count"},
            "samples_per_s": float(np.mean(throughputs)) if throughputs else float("nan"),
            "peak_mem_mb": peak_memory_mb(self.device),
            "live_rank": size["live_rank"],
            "tt_bytes": size["tt_bytes"],
            "model_bytes": size["model_bytes"],
            **({"target_bytes": self.schedule.target_bytes()} if self.schedule.target_bytes() is not None else {}),
            "compression": size["compression"],
            "truncations": self.truncations,
            "nonfinite_skipped": self.nonfinite,
            "stage": self.schedule.stage,
            "wall_s": time.perf_counter() - wall0,
        }
        return summary

    def _write_summary(self, summary: dict[str, Any], log: Optional[JsonlLog]) -> None:
        """Rank 0: print the summary table, write summary.txt / summary.json, the summary
        record and the plots."""
        import json

        cfg = self.config
        table = summary_table(summary)
        print(table, flush=True)
        (self.run_dir / "summary.txt").write_text(table + "\n")
        (self.run_dir / "summary.json").write_text(
            json.dumps(
                {**summary, "live_ranks": model_live_ranks(self.model, self.schedule.config.threshold)},
                indent=1,
                default=str,
            )
        )
        if log is not None:
            log.write({"kind": "summary", **summary})
        if cfg.plots:
            plot_run(read_jsonl(self.run_dir / "log.jsonl"), self.run_dir)
