"""The serving benchmark's set-up (:mod:`comera_rec.dlrm.serving`): what it runs
(:class:`ServingSetup`), the two models' configurations, the input batches and where the
model files go."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from comera_rec.dlrm.config import DLRMConfig

VARIANTS = ("dense_eager", "dense_export", "tt_eager", "tt_export", "tt_kernels")
EXPORTED_FORMS = ("export", "kernels")  # the variants run as exported programs in a torch-only interpreter
INPUTS = "inputs.pt"  # the batches every variant scores, written once by the preparing process

# --quick: 26 small tables, four of them (>= 10k rows) TT-compressed
TINY_TABLE_SIZES = (
    20000, 15000, 300, 40, 12000, 7, 500, 60, 3, 900, 20, 11, 50,
    4, 1000, 30000, 8, 100, 70, 4, 9000, 10, 12, 800, 90, 200,
)  # fmt: skip


@dataclass
class ServingSetup:
    """What the benchmark runs (see :func:`main` for the command line)."""

    batch_sizes: tuple[int, ...] = (1, 64, 512, 4096)
    iters: int = 100
    """Timed batches per batch size and process."""
    warmup: int = 5
    """Untimed batches per batch size first."""
    distinct: int = 8
    """Distinct batches per size, cycled."""
    rounds: int = 1
    """Fresh processes per variant (the variants alternating); medians over them."""
    zipf: float = 1.1
    rank: int = 32
    threads: int = 1
    quick: bool = False
    """Tiny shapes (:data:`TINY_TABLE_SIZES`, dim 8, rank 4)."""
    heap_reuse: bool = True
    """Every measuring process lets glibc malloc keep freed blocks up to 256 MiB for reuse
    (``keep_freed_memory(mmap_threshold_bytes=SERVING_MMAP_THRESHOLD)``, as predict_dlrm
    does); ``False``: glibc's defaults, where every batch's activations above its adaptive
    threshold (at most 32 MiB) are fresh pages."""
    mlperf: bool = False
    """MLPerf DLRM-DCNv2 shapes (``DLRMConfig.mlperf_dcn``: 26 tables of 204M rows in all, dim
    128, DCN interaction): the compressed variants only, the dense tables needing 97 GiB."""
    workdir: Optional[str] = None
    """Where the model files go; a temporary folder (removed) when ``None``."""
    variants: tuple[str, ...] = field(default=VARIANTS)
    start_method: str = "spawn"
    """How the preparing and the eager processes start: ``"spawn"`` (fresh interpreters,
    as servers start) or ``"forkserver"``. Not ``"fork"``: a copy of a process whose
    OpenMP and gloo threads hold locks can hang for ever (it did inside the test suite).
    The exported variants always run in a fresh torch-only interpreter."""


def model_config(kind: str, setup: ServingSetup) -> DLRMConfig:
    """``"dense"``: TorchRec's DLRM as it ships; ``"tt"``: the compressed one, as trained."""
    if setup.quick:
        base = DLRMConfig(
            table_sizes=list(TINY_TABLE_SIZES),
            embedding_dim=8,
            bottom_mlp=[64, 32, 8],
            top_mlp=[64, 32, 1],
            min_rows_to_compress=10_000,
            min_params_to_compress=0,
            rank=4,
            mlp_rank=4,
        )
    elif setup.mlperf:
        base = DLRMConfig.mlperf_dcn(rank=setup.rank, mlp_rank=setup.rank)
    else:
        base = DLRMConfig.kaggle(rank=setup.rank, mlp_rank=setup.rank)
    if setup.mlperf:  # its interaction is the DCN for both kinds
        return replace(base, compressed=kind != "dense")
    if kind == "dense":
        return replace(base, compressed=False, fused_interaction=False)
    return replace(base, compressed=True, fused_interaction=True)


def batches(setup: ServingSetup, batch_size: int) -> list:
    """``setup.distinct`` synthetic Criteo batches of ``batch_size`` rows, Zipf ids."""
    # imported here: the measuring processes read their inputs from a file, and a server
    # imports no data readers (their pyarrow is ~40 MB of a process's RSS)
    from comera_rec.data import SyntheticCriteo, SyntheticCriteoConfig

    data = SyntheticCriteo(
        SyntheticCriteoConfig(
            num_embeddings_per_feature=list(model_config("dense", setup).table_sizes),
            zipf_exponent=setup.zipf,
            batch_size=batch_size,
            num_rows=batch_size * setup.distinct,
            seed=1,
            stream="val",
            drop_last=True,
        )
    )
    return list(data)


def paths(workdir: str, kind: str) -> tuple[Path, Path]:
    """``(eager state dict, exported program)`` files of model ``kind``."""
    return Path(workdir) / f"{kind}_state.pt", Path(workdir) / f"{kind}.pt2"


def variant_file(workdir: str, variant: str) -> Path:
    """The file variant ``variant`` loads: the state dict (``*_eager``), the exported program
    (``*_export``) or the program calling the operator library (``*_kernels``)."""
    kind, form = variant.split("_")
    state, program = paths(workdir, kind)
    return {"eager": state, "export": program}.get(form, Path(workdir) / f"{kind}_kernels.pt2")
