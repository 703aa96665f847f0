"""Communication per step as the world grows (docs/scaling.md), from a checkout.

    python launch/bench_scaling.py              # counts from the meta-device models + the modelled projection
    python launch/bench_scaling.py --measure    # + real steps counted on gloo with 1, 2, 4 processes

All the logic is :mod:`comera_rec.dlrm.scaling`.
"""

from __future__ import annotations

from comera_rec.dlrm.scaling import main

if __name__ == "__main__":
    main()
