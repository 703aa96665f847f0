"""Pre-train a RoBERTa-style (CodeBERT) masked-LM on code, in two phases.

    python launch/train_codebert.py --config configs/codebert_tiny.yaml
    python launch/train_codebert.py --config configs/codebert_tiny.yaml data.source=/src/project method.name=dense
    python launch/train_codebert.py --config configs/codebert_base.yaml data.source=/data/codesearchnet/python

Phase 1 runs trainer.max_steps steps; phase 2 (phase2.*) starts by cutting ranks further
and runs phase2.steps more. Fields: docs/transformer.md and docs/training.md.
"""

from __future__ import annotations

import math

from comera_rec.config import run_config_from_args
from comera_rec.transformer.runs import MaskedLMRun, run_masked_lm
from comera_rec.utils.logs import setup_logging


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    config = run_config_from_args(
        MaskedLMRun,
        argv,
        __doc__,
        config_help="YAML run config (configs/codebert_*.yaml)",
        resume_help="continue each phase from its newest checkpoint",
        overrides_help="section.key=value, e.g. phase2.rank_fraction=0.3",
    )
    if config is None:  # --help-config
        return {}
    out = run_masked_lm(config)
    for phase in ("phase1", "phase2"):
        s = out.get(phase)
        if s:
            print(
                f"{phase}: val MLM loss {s['val_log_loss']:.4f}, perplexity {s['val_perplexity']:.2f}, "
                f"accuracy {s['val_accuracy']:.4f}, compression {s['compression']:.1f}x, "
                f"{s['parameters']:,} parameters" + ("" if math.isfinite(s["val_log_loss"]) else " (no validation)")
            )
    return out


if __name__ == "__main__":
    main()
