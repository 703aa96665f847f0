"""The fused CPU scoring kernels as PyTorch operators (``torch.ops.comera_rec.*``), for
exported programs.

An exported DLRM (:func:`comera_rec.dlrm.export.export_dlrm`) is made of plain PyTorch
operators by default, and runs wherever torch does. With ``kernels=True`` its TTM lookups,
TT layers, pairwise-dot interaction and DCN cross net are instead calls of operators of a small C++
library (``serving_ops_cpu.cpp``, built from the fused kernels' sources as the other CPU
kernels are: :class:`~comera_rec.tensor.kernels.cpu_extension.CpuExtension`):

* ``comera_rec::ttm_halves_bags``: the whole sparse lookup: the bags of TTM-table
  features pooled over their tables' precontracted halves (two rows per id), those of
  uncompressed tables from their rows, all written sample-major ``(B, F, D)`` in one pass;
* ``comera_rec::tt_linear``: ``relu?(x @ left @ right + bias)``, a TT layer's merged
  chains in one pass over the rows;
* ``comera_rec::pairwise_dots``: DLRM's dot interaction in one pass;
* ``comera_rec::tt_cross``: a DCN cross net whose layers are merged TT weights, row blocks
  taken through every layer at once, its input's column blocks read where they are.

A server runs such a program with torch alone, after loading the library::

    torch.ops.load_library(path)          # path: operator_library() where it was built
    model = torch.export.load("model.pt2").module()

The library is built for the machine that builds it (``-march=native``, as the other CPU
kernels): build it on (a machine like) the serving host, ``python -m
comera_rec.tensor.kernels comera_rec.dlrm.serving_ops``. The programs' operands do not
depend on the vector width, so one exported program serves AVX2 and AVX-512 hosts alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from comera_rec.tensor.kernels.cpu_extension import KERNELS_DIR, CpuExtension, register_cpu_extension

_HERE = Path(__file__).parent

LIBRARY = register_cpu_extension(
    CpuExtension(
        "comera_ops",
        [
            _HERE / "serving_ops_cpu.cpp",
            KERNELS_DIR / "ttm_cpu.cpp",
            KERNELS_DIR / "tt_linear_cpu.cpp",
            _HERE / "interaction_cpu.cpp",
        ],
        "the scoring operators for exported programs (torch.ops.comera_rec)",
        "programs export with plain PyTorch operators only",
        defines=["COMERA_OPERATOR_LIBRARY"],
        python_module=False,
    )
)

NAMESPACE = "comera_rec"
OPERATORS = ("ttm_halves_bags", "tt_linear", "pairwise_dots", "tt_cross")
HALVES_PAD_BYTES = 64
"""The TTM halves' rank is zero-padded to a multiple of this many bytes in a program: whole
vectors at every width (16, 32 and 64 bytes), so one program runs on every x86 host."""


def operator_library() -> Optional[Path]:
    """Build (when needed) and load the operator library into this process; its path, or
    ``None`` when it cannot be built (no C++ compiler, a failed build: logged) or the CPU
    kernels are switched off (:func:`~comera_rec.tensor.kernels.set_cpu_kernel_enabled`,
    ``COMERA_DISABLE_CPU_KERNEL``).

    Example::

        >>> path = operator_library()  # doctest: +SKIP
        >>> torch.ops.comera_rec.pairwise_dots(torch.ones(2, 4), torch.ones(2, 3, 4)).shape  # doctest: +SKIP
        torch.Size([2, 10])
    """
    if not LIBRARY.enabled():
        return None
    return Path(str(LIBRARY.load()))


def operators_loaded() -> bool:
    """Whether ``torch.ops.comera_rec``'s operators are registered in this process (by
    :func:`operator_library`, or a server's ``torch.ops.load_library``)."""
    namespace = getattr(torch.ops, NAMESPACE)
    try:
        return all(getattr(namespace, name) is not None for name in OPERATORS)
    except (AttributeError, RuntimeError):
        return False
