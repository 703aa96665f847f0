"""The accuracy-size front from a checkout: fixed-rank training against the budget rank schedule.

    python launch/bench_rank.py                        # the demo front, 2 seeds (~15 min here)
    python launch/bench_rank.py --preset kaggle        # Kaggle table sizes, synthetic data
    python launch/bench_rank.py --seeds 0 --targets 0.25 --fixed 4 8 16   # a quick look

The same as the installed console script ``comera-bench-rank``: both run
:func:`comera_rec.dlrm.bench_rank.main`, whose module text says what is run, printed and written.
"""

from __future__ import annotations

from comera_rec.dlrm.bench_rank import main

if __name__ == "__main__":
    raise SystemExit(main())
