"""Score Criteo rows with a trained DLRM checkpoint (``launch/predict_dlrm.py``).

The model is rebuilt from the run config stored in the checkpoint (or a given one that
must agree with it), wrapped and loaded exactly as the trainer resumes a run (ranks
resized to the checkpoint's, weights-only load), and the input files are read by the
training readers with the run's categorical transform (vocabularies or hashing). So a
prediction over the run's validation files gives the trainer's own AUC and log loss.

One process, or several under ``torchrun``: each process loads the whole model, scores its
contiguous part of the input rows and writes a part file; process 0 then joins the parts
in input order into the one output file (the same rows, in the same order, as one process
writes) and the metrics are computed over every process's rows. A checkpoint written by
several processes is read whole from its shared DCP part (sharded tables gathered); one in
the older per-process format is refused (its dense tables are split across the rank files).
"""

from __future__ import annotations

import argparse
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch

from comera_rec.config import from_dict, to_dict
from comera_rec.data import CriteoNpyReader, CriteoParquetReader, CriteoReaderConfig, CriteoTsvReader
from comera_rec.data.criteo import NO_LABEL
from comera_rec.dlrm.task import DLRMRunConfig, DLRMTask, load_run_config
from comera_rec.rank import resize_to_state_dict
from comera_rec.tensor import cached_weights
from comera_rec.training import BinaryMetrics, IncompatibleCheckpointError, latest_checkpoint, load_checkpoint
from comera_rec.training.checkpoint import is_complete, restore_local
from comera_rec.training.dist import is_distributed
from comera_rec.training.engine import config_differences, state_dict_mismatches
from comera_rec.utils.host import SERVING_MMAP_THRESHOLD, keep_freed_memory
from comera_rec.utils.logs import setup_logging

PathLike = Union[str, Path]
# input suffix -> reader (".gz": gzipped TSV)
_FORMATS = {".tsv": "tsv", ".txt": "tsv", ".gz": "tsv", ".parquet": "parquet", ".npy": "npy"}
_READERS = {"tsv": CriteoTsvReader, "parquet": CriteoParquetReader, "npy": CriteoNpyReader}


class CheckpointNotFoundError(FileNotFoundError):
    """``--checkpoint`` names no complete checkpoint (no such path, or no finished one in it)."""


class CheckpointConfigMismatchError(IncompatibleCheckpointError):
    """The given run config describes another model than the one in the checkpoint."""


def find_checkpoint(path: PathLike) -> Path:
    """The checkpoint folder ``path`` names.

    Args:
        path: a run directory (its newest complete checkpoint in ``checkpoints/``), a
            checkpoints folder, a ``step_*`` folder, or a ``rank0.pt`` file in one.

    Raises:
        CheckpointNotFoundError: the path does not exist, or holds no complete checkpoint.

    Example::

        >>> find_checkpoint("runs/dlrm_demo")  # doctest: +SKIP
        PosixPath('runs/dlrm_demo/checkpoints/step_000001500')
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"--checkpoint {path}: no such file or directory")
    if p.is_file():
        p = p.parent
    if is_complete(p):
        return p
    for root in (p / "checkpoints", p):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise CheckpointNotFoundError(
        f"--checkpoint {path}: no complete checkpoint there (looked for a step_* folder with meta.json in "
        f"{p / 'checkpoints'} and {p}); give a run directory, its checkpoints/ folder or a step_* folder"
    )


@dataclass
class LoadedModel:
    """A trained model ready to score, and what it was built from."""

    model: nn.Module
    """The wrapped training module (``DLRMTrain``): ``batch -> (loss, (loss, logits, labels))``."""
    config: DLRMRunConfig
    """The run config the model was built from (table sizes filled in from the data)."""
    checkpoint: Path
    """The checkpoint folder loaded."""
    step: int
    """Optimiser steps of the checkpoint."""
    device: torch.device
    """Where the model runs."""


def load_model(checkpoint: PathLike, config: Optional[PathLike] = None, device: str = "cpu") -> LoadedModel:
    """Rebuild the model of a DLRM checkpoint and load its weights, as the trainer resumes.

    Args:
        checkpoint: see :func:`find_checkpoint`.
        config: a run config (YAML path or shipped name); its ``model`` section must be the
            checkpoint's. ``None``: the config stored in the checkpoint's ``meta.json``.
        device: ``"cpu"`` or a CUDA device.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``checkpoint``.
        CheckpointConfigMismatchError: ``config`` (or the stored one) does not describe the
            checkpoint's model; the message lists the differing keys and tensors.
        ValueError: the checkpoint was written by several processes in the older
            per-process format (no ``shared/`` part), or stores no config and none is given.

    Example::

        >>> loaded = load_model("runs/dlrm_demo")  # doctest: +SKIP
        >>> loaded.step  # doctest: +SKIP
        1500
    """
    path = find_checkpoint(checkpoint)
    state, meta = load_checkpoint(path, rank=0)
    if int(meta.get("world_size", 1)) != 1 and "shared" not in meta:
        raise ValueError(
            f"{path} was written by {meta['world_size']} processes in the older per-process format: each "
            f"rank file holds only part of the sharded tables; predict reads those from one process only"
        )
    saved = meta.get("config")
    if config is None and saved is None:
        raise ValueError(f"{path}/meta.json stores no run config; pass --config with the run's config")
    run_config = load_run_config(str(config)) if config is not None else from_dict(DLRMRunConfig, saved)
    task = DLRMTask(run_config)
    model = task.build_model(torch.device(device))  # fills table sizes from the data, as in training
    # only the model section defines the weights; data / trainer may differ freely
    problems = (
        [f"config {d}" for d in config_differences(saved, to_dict(run_config), ignore=()) if d.startswith("model.")]
        if saved is not None
        else []
    )
    problems += state_dict_mismatches(model, state["model"])
    if problems:
        shown = problems[:12] + ([f"... {len(problems) - 12} more"] if len(problems) > 12 else [])
        where = f"--config {config}" if config is not None else "the config stored in the checkpoint"
        raise CheckpointConfigMismatchError(
            f"{where} does not describe the model of checkpoint {path}: "
            + "; ".join(shown)
            + ". Leave out --config to use the checkpoint's own, or pass the config the run was trained with."
        )
    resize_to_state_dict(model, state["model"])  # ranks cut by truncation during training
    wrapped = task.wrap(model)
    model.load_state_dict(restore_local(model.state_dict(), state["model"], "model"))
    wrapped.eval()
    return LoadedModel(wrapped, run_config, path, int(meta.get("step", 0)), task.device)


def input_format(paths: Sequence[PathLike]) -> str:
    """``"tsv"``, ``"parquet"`` or ``"npy"`` from the files' suffixes (all must agree).

    Example::

        >>> input_format(["day_0.tsv.gz", "day_1.tsv.gz"])
        'tsv'
    """
    kinds = set()
    for p in paths:
        suffix = Path(p).suffix.lower()
        if suffix not in _FORMATS:
            raise ValueError(f"{p}: cannot tell the format from the suffix {suffix!r}; pass --format tsv|parquet|npy")
        kinds.add(_FORMATS[suffix])
    if len(kinds) != 1:
        raise ValueError(f"inputs of several formats {sorted(kinds)}; score one format per call")
    return kinds.pop()


def read_batches(
    paths: Sequence[PathLike],
    config: DLRMRunConfig,
    *,
    batch_size: int,
    fmt: Optional[str] = None,
    bad_input: str = "strict",
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[Batch]:
    """Batches of the input files in row order, with the run's categorical transform.

    Args:
        paths: Criteo TSV (plain or gzip, with or without the label column), Parquet
            (``data/preprocess_criteo.py`` layout) or npy (``*_dense.npy``) files.
        config: the run config (its ``data`` section gives vocabularies or hashing sizes).
        batch_size: rows per batch.
        fmt: ``"tsv"``, ``"parquet"`` or ``"npy"``; from the suffixes when ``None``.
        bad_input: ``"strict"`` (a malformed line is an error naming file and line, so that
            every output row is an input row) or ``"skip"`` (dropped, as in training).
        rank: this process's part of the rows (contiguous parts, in rank order).
        world_size: the number of parts.
    """
    fmt = fmt or input_format(paths)
    if fmt not in _READERS:
        raise ValueError(f"format must be one of {sorted(_READERS)}, got {fmt!r}")
    data = config.data
    reader = _READERS[fmt](
        CriteoReaderConfig(
            paths=[str(p) for p in paths],
            batch_size=batch_size,
            split="all",
            holdout="none",
            num_embeddings_per_feature=data.num_embeddings_per_feature,
            vocab_dir=data.vocab_dir if data.source != "synthetic" else None,
            bad_input=bad_input,
            rank=rank,
            world_size=world_size,
        )
    )
    return iter(reader)


@dataclass
class PredictionResult:
    """What :func:`predict` wrote and measured."""

    rows: int
    """Rows scored (one output row each), by every process."""
    out: Path
    """The output file."""
    checkpoint: Path
    """The checkpoint used."""
    metrics: Optional[dict[str, float]]
    """``{"auc", "accuracy", "log_loss", "count"}`` when the input has labels, else ``None``."""


class _Writer:
    """Streams ``score`` (and ``label``) columns to Parquet or CSV, one batch at a time."""

    def __init__(self, out: Path, with_label: bool) -> None:
        fields = [pa.field("score", pa.float32())] + ([pa.field("label", pa.int8())] if with_label else [])
        self.schema = pa.schema(fields)
        suffix = out.suffix.lower()
        if suffix == ".parquet":
            self._writer = pq.ParquetWriter(out, self.schema)
        elif suffix == ".csv":
            self._writer = pacsv.CSVWriter(out, self.schema)
        else:
            raise ValueError(f"--out {out}: the suffix must be .parquet or .csv")

    def write(self, scores: torch.Tensor, labels: Optional[torch.Tensor]) -> None:
        columns = [pa.array(scores.cpu().numpy())]
        if labels is not None:
            columns.append(pa.array(labels.cpu().to(torch.int8).numpy()))
        self._writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))

    def close(self) -> None:
        self._writer.close()


def part_path(out: Path, rank: int) -> Path:
    """Where process ``rank`` of a multi-process prediction writes its rows.

    Example::

        >>> part_path(Path("scores.parquet"), 1).name
        'scores.part00001.parquet'
    """
    return out.with_name(f"{out.stem}.part{rank:05d}{out.suffix}")


def join_parts(parts: Sequence[Path], out: Path) -> None:
    """Concatenate the processes' part files, in order, into ``out`` and remove them.

    Parts without rows (a process whose share of the input was empty) are left out, so the
    columns are those of the parts that hold rows. CSV parts are joined as text (their
    numbers stay as written), Parquet parts table by table.
    """
    tmp = out.with_name(f".{out.name}.joining")
    if out.suffix.lower() == ".csv":
        pieces = []
        for part in parts:
            with open(part, "rb") as src:
                pieces.append((src.readline(), src.read()))  # (header line, rows)
        header = next((head for head, body in pieces if body), pieces[0][0])
        with open(tmp, "wb") as dst:
            dst.write(header)
            for _, body in pieces:
                dst.write(body)
    else:
        tables = [pq.read_table(part) for part in parts]
        full = [t for t in tables if t.num_rows] or tables[:1]
        writer = pq.ParquetWriter(tmp, full[0].schema)
        for t in full:
            writer.write_table(t)
        writer.close()
    tmp.replace(out)  # readers never see a half-joined output
    for part in parts:
        part.unlink()


def _labelled(labels: torch.Tensor) -> bool:
    """Whether a batch carries labels (rows of unlabelled files have ``NO_LABEL``)."""
    return bool((labels != NO_LABEL).all())


@torch.no_grad()
def predict(
    checkpoint: PathLike,
    inputs: Sequence[PathLike],
    out: PathLike,
    *,
    config: Optional[PathLike] = None,
    batch_size: Optional[int] = None,
    fmt: Optional[str] = None,
    bad_input: str = "strict",
    device: str = "cpu",
    progress: bool = True,
) -> PredictionResult:
    """Score every input row with a trained model; write one probability per row.

    Under ``torchrun`` with several processes every process calls it: each loads the whole
    model, then joins a process group (gloo on CPU, nccl on CUDA; started here, after the
    load, and ended before returning), scores its part of the rows, and ``out`` receives
    all of them in input order.

    Args:
        checkpoint: a run directory, checkpoints folder, ``step_*`` folder or rank file.
        inputs: Criteo files (see :func:`read_batches`), read in order.
        out: ``.parquet`` or ``.csv``; columns ``score`` (the click probability,
            ``sigmoid(logit)``) and, when the input has labels, ``label``.
        config: a run config that must match the checkpoint's model (see :func:`load_model`).
        batch_size: rows per batch; the run's validation batch size when ``None``.
        fmt: input format; from the suffixes when ``None``.
        bad_input: ``"strict"`` or ``"skip"`` (see :func:`read_batches`).
        device: where the model runs.
        progress: show a tqdm bar of rows scored.

    Returns:
        The rows written, and with labels AUC, accuracy and log loss (the trainer's
        :class:`~comera_rec.training.BinaryMetrics`).

    Raises:
        CheckpointNotFoundError, CheckpointConfigMismatchError: see :func:`load_model`.
        FileNotFoundError: an input file is missing.
        ValueError: an unknown format or output suffix; labelled and unlabelled inputs mixed.

    Example::

        >>> result = predict("runs/dlrm_demo", ["day_23.tsv"], "scores.parquet")  # doctest: +SKIP
        >>> result.metrics["auc"]  # doctest: +SKIP
    """
    out = Path(out)
    if out.suffix.lower() not in (".parquet", ".csv"):
        raise ValueError(f"--out {out}: the suffix must be .parquet or .csv")
    if is_distributed():
        raise RuntimeError(
            "predict() loads a whole model in every process and starts its own process group under "
            "torchrun; call it before init_process_group"
        )
    loaded = load_model(checkpoint, config, device)  # before the group: one whole model per process
    started = _join_torchrun(device)
    try:
        return _score(loaded, inputs, out, batch_size, fmt, bad_input, progress)
    finally:
        if started:
            del loaded
            gc.collect()  # gloo aborts at exit now and then while the run's tensors are alive
            dist.destroy_process_group()


def _score(
    loaded: LoadedModel,
    inputs: Sequence[PathLike],
    out: Path,
    batch_size: Optional[int],
    fmt: Optional[str],
    bad_input: str,
    progress: bool,
) -> PredictionResult:
    """:func:`predict` once the model is loaded (and the process group, if any, started)."""
    from tqdm import tqdm

    data = loaded.config.data
    rank, world = (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)
    final_out, out = out, (out if world == 1 else part_path(out, rank))
    batches = read_batches(
        inputs,
        loaded.config,
        batch_size=batch_size or data.val_batch_size or data.batch_size,
        fmt=fmt,
        bad_input=bad_input,
        rank=rank,
        world_size=world,
    )
    metrics = BinaryMetrics(loaded.device)
    writer: Optional[_Writer] = None
    with_label: Optional[bool] = None
    rows = 0
    bar = tqdm(unit="rows", desc="predict", disable=not progress)
    try:
        with cached_weights():  # the cores' derived forms made once, not per batch
            for batch in batches:
                labelled = _labelled(batch.labels)
                if with_label is None:
                    with_label = labelled
                    out.parent.mkdir(parents=True, exist_ok=True)
                    writer = _Writer(out, with_label)
                elif labelled != with_label:
                    raise ValueError("the inputs mix rows with and without labels; score them in separate calls")
                # the training forward (loss on the labels, which unlabelled rows ignore)
                _, (_, logits, labels) = loaded.model(batch.to(loaded.device))
                logits = logits.reshape(-1)
                if with_label:
                    metrics.update(logits, labels)
                assert writer is not None
                writer.write(torch.sigmoid(logits.float()), labels if with_label else None)
                rows += logits.numel()
                bar.update(logits.numel())
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    if writer is None:  # no rows at all: still an output file, with its columns
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = _Writer(out, False)
        writer.close()
    if world == 1:
        return PredictionResult(rows, out, loaded.checkpoint, metrics.compute() if with_label else None)
    # every process: whether any rows had labels (a process may have had none), the rows in all
    flags = torch.tensor([rows, int(bool(with_label)), int(rows > 0)], dtype=torch.int64)
    dist.all_reduce(flags)
    any_label = int(flags[1]) > 0
    if any_label and int(flags[1]) != int(flags[2]):
        raise ValueError("the inputs mix rows with and without labels; score them in separate calls")
    result_metrics = metrics.compute() if any_label else None  # collective
    dist.barrier()  # every part is written
    if rank == 0:
        join_parts([part_path(final_out, r) for r in range(world)], final_out)
    dist.barrier()  # the output is complete on every process's return
    return PredictionResult(int(flags[0]), final_out, loaded.checkpoint, result_metrics)


_USAGE = """Score Criteo rows with a trained DLRM; print AUC and log loss when the rows have labels.

    python launch/predict_dlrm.py --checkpoint runs/dlrm_demo day_23.tsv --out scores.parquet
    python launch/predict_dlrm.py --checkpoint runs/x/checkpoints/step_000001500 \\
        --config configs/dlrm_criteo_kaggle.yaml test.parquet --out scores.csv

The output holds one row per input row: ``score`` (click probability) and ``label`` when
the input has one; Parquet or CSV by the suffix of --out. Under torchrun each process
scores its part of the rows and process 0 joins the parts into --out. See docs/serving.md.
"""


def _join_torchrun(device: str) -> bool:
    """Under ``torchrun`` with several processes, start the process group (gloo on CPU,
    nccl on CUDA, each process on its local GPU); whether one was started."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return True


def predict_cli(argv: Optional[Sequence[str]] = None) -> dict:
    """The command line of ``launch/predict_dlrm.py``: parse ``argv`` (``None``:
    ``sys.argv[1:]``), score, print the rows written and, with labels, AUC and log loss.

    Returns:
        ``{"rows", "out", "checkpoint"}`` plus ``auc``, ``accuracy``, ``log_loss`` and
        ``count`` when the input has labels.

    Example::

        >>> predict_cli(["--checkpoint", "runs/dlrm_demo", "val.tsv", "--out", "s.parquet"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description=_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint", required=True, help="run directory, checkpoints/ folder, step_* folder or rank0.pt"
    )
    parser.add_argument(
        "--config", help="run config (must match the checkpoint's model); default: the checkpoint's own"
    )
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="Criteo TSV (.tsv/.txt/.gz), .parquet or *_dense.npy files"
    )
    parser.add_argument("--out", required=True, help="output file, .parquet or .csv")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="rows per batch (default: the run's validation batch size)"
    )
    parser.add_argument(
        "--format", choices=sorted(_READERS), default=None, help="input format (default: from the suffix)"
    )
    parser.add_argument(
        "--bad-input",
        choices=["strict", "skip"],
        default="strict",
        help="malformed lines: error (default; every output row is an input row) or skip",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    setup_logging()
    result = predict(
        args.checkpoint,
        args.inputs,
        args.out,
        config=args.config,
        batch_size=args.batch_size,
        fmt=args.format,
        bad_input=args.bad_input,
        device=args.device,
        progress=not args.no_progress and int(os.environ.get("RANK", "0")) == 0,
    )
    summary = {"rows": result.rows, "out": str(result.out), "checkpoint": str(result.checkpoint)}
    summary.update(result.metrics or {})
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: process 0 reports for all
        return summary
    print(f"checkpoint {result.checkpoint}: scored {result.rows} rows into {result.out}")
    if result.metrics is not None:
        print(
            f"AUC {result.metrics['auc']:.10f}  log loss {result.metrics['log_loss']:.10f}  "
            f"accuracy {result.metrics['accuracy']:.6f}"
        )
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script ``comera-predict-dlrm``: :func:`predict_cli`, exit status 0 (a
    console script exits with what ``main`` returns; the result dict would exit 1).

    A scoring process of its own, so it also sets malloc for large batches (process-wide:
    freed blocks up to 256 MiB reused, not page-faulted afresh every batch; see
    :func:`~comera_rec.utils.host.keep_freed_memory`)."""
    keep_freed_memory(mmap_threshold_bytes=SERVING_MMAP_THRESHOLD)
    predict_cli(argv)
    return 0
