"""DLRM benchmark from a checkout: compressed vs dense TorchRec DLRM at Criteo Kaggle shapes.

    python launch/bench_dlrm.py                 # Kaggle shapes, batch 2048
    python launch/bench_dlrm.py --mlperf        # MLPerf DLRM-DCNv2 shapes, compressed only
    python launch/bench_dlrm.py --quick         # a smoke run
    python launch/bench_dlrm.py --parts         # where the step goes, per part
    python launch/bench_dlrm.py --ops tt        # each operator on one thread and on two
    python launch/bench_dlrm.py --rounds 5      # more fresh processes per variant for the step time
    python launch/bench_dlrm.py --lookup-paths  # also the compressed models with the fused CPU kernels off
    python launch/bench_dlrm.py --isa avx2      # every library limited to AVX2 code (on an AVX-512 host)

The same as the installed console script ``comera-bench``: both run :func:`comera_rec.dlrm.bench.main`,
whose help (``--help``) and module text say what is measured and how.
"""

from __future__ import annotations

from comera_rec.dlrm.bench import main

if __name__ == "__main__":
    main()
