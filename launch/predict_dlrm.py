"""Score Criteo rows with a trained DLRM; print AUC and log loss when the rows have labels.

    python launch/predict_dlrm.py --checkpoint runs/dlrm_demo day_23.tsv --out scores.parquet
    python launch/predict_dlrm.py --checkpoint runs/x/checkpoints/step_000001500 \
        --config configs/dlrm_criteo_kaggle.yaml test.parquet --out scores.csv

`--checkpoint` takes a run directory (its newest checkpoint), a checkpoints/ folder, a
step_* folder or its rank0.pt. The output holds one row per input row: `score` (click
probability) and `label` when the input has one; Parquet or CSV by the suffix of --out.
The logic lives in dlrm/predict.py; see docs/serving.md.
"""

from __future__ import annotations

from comera_rec.dlrm.predict import main as console_main
from comera_rec.dlrm.predict import predict_cli as main  # noqa: F401  (in-process callers: the result dict)

if __name__ == "__main__":
    raise SystemExit(console_main())  # also sets malloc for scoring (see console_main)
