"""Train a (compressed) DLRM on Criteo or synthetic Criteo-shaped data, from a checkout.

    python launch/train_dlrm.py --config configs/dlrm_demo.yaml [section.key=value ...]
    torchrun --nproc_per_node=2 launch/train_dlrm.py --config configs/dlrm_demo.yaml
    python launch/train_dlrm.py --config configs/dlrm_demo.yaml --resume

The same as the installed console script ``comera-train-dlrm``: both run
:func:`comera_rec.dlrm.cli.train` (the options are there). Every field of every section is
documented in docs/training.md and docs/dlrm.md; `--help-config` prints them with their
current values.
"""

from __future__ import annotations

from comera_rec.dlrm.cli import train as main

if __name__ == "__main__":
    main()
