"""Serving benchmark from a checkout: compressed vs dense TorchRec DLRM scoring rows,
eager and exported (``torch.export``), at Criteo Kaggle shapes.

    python launch/bench_serving.py                                # batches 1, 64, 512, 4096
    python launch/bench_serving.py --batches 1 4096 --iters 30    # a shorter run
    python launch/bench_serving.py --quick                        # tiny shapes, a smoke run

Runs :func:`comera_rec.dlrm.serving.main`, whose help (``--help``) and module text say what
is measured and how; see docs/serving.md.
"""

from __future__ import annotations

import os
import sys

from comera_rec.dlrm.serving import main

if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: Triton (imported by TorchRec) prints leak warnings at exit
