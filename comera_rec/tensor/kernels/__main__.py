"""Build the fused CPU kernels now: ``python -m comera_rec.tensor.kernels [--require] [MODULE ...]``.

``make``'s set-up runs this after installing the package, so that the build (1-3 min, once
per machine and source version) happens there and not inside the first training step. It
prints one line before a build and one after (the time and the cache folder), or one line
when they are built already, disabled (``COMERA_DISABLE_CPU_KERNEL=1``) or cannot be built
(no C++ compiler: the PyTorch path is used). Exits 0 in all these cases; with
``--require``, 1 when the kernels are not ready. The modules named after the options are
imported first: those that register CPU kernels of their own (``comera_rec.dlrm.interaction_kernel``,
``comera_rec.integration.rowwise_bag_kernel``, as the Makefile names them) get them built too.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from comera_rec.tensor.kernels.cpu_extension import build_cpu_kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m comera_rec.tensor.kernels", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--require",
        action="store_true",
        help="exit 1 when the kernels are not ready (disabled, or no compiler / a failed build)",
    )
    parser.add_argument(
        "modules",
        nargs="*",
        metavar="MODULE",
        help="modules to import first: the CPU kernels they register are built too",
    )
    args = parser.parse_args(argv)
    for name in args.modules:
        importlib.import_module(name)
    result = build_cpu_kernels(lambda line: print(line, flush=True))
    return 1 if args.require and not result.ready else 0


if __name__ == "__main__":
    sys.exit(main())
