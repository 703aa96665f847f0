"""Reading and writing a checkpoint's DCP folder without unpickling arbitrary objects.

DCP unpickles its ``.metadata`` file with plain ``pickle`` and loads non-tensor values
with ``torch.load(weights_only=False)``. :class:`SafeReader` unpickles the metadata with an
allow-list of DCP's own record classes, ``torch.Size`` and dtypes, and only tensors are
ever stored or requested (:func:`save_shared`, :func:`load_whole`, :func:`load_into`), so
no pickled code runs. Re-exported by :mod:`comera_rec.training.dcp_state`.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

# What a DCP .metadata file may name: DCP's own records, torch.Size, dtypes, a path
ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name in ("Size", "device") or isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names {module}.{name}, which is not a DCP record type; refused (never run)"
        )


class SafeReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose metadata is read with an allow-list unpickler.

    Args:
        path: the DCP folder.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        super().__init__(str(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata; refuses a file naming any other type."""
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path}/.metadata holds a {type(metadata).__name__}, not DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------------------- storage
def process_group_initialized() -> bool:
    """Whether a torch.distributed process group is initialised (of any size)."""
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def one_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: that is what is asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_shared(folder: Path, flat: dict[str, Any], group: Any = None) -> list[Path]:
    """Write ``flat`` with DCP into ``folder`` (collective when a group is initialised).

    Args:
        folder: the DCP folder (created by rank 0 before the call).
        flat: flat key -> tensor (replicated: the same on every process) or ShardedTensor.
        group: the process group DCP plans over (None: the default group).

    Returns:
        The files this process wrote (``__R_*.distcp``, and ``.metadata`` on rank 0), for
        the checksums.
    """
    grouped = process_group_initialized()
    with one_process_quiet():
        writer = dcp.FileSystemWriter(str(folder), sync_files=True)
        dcp.save(flat, storage_writer=writer, process_group=group, no_dist=not grouped)
    rank = dist.get_rank() if grouped else 0
    mine = sorted(folder.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(folder / ".metadata")
    return mine


def read_metadata(folder: Union[str, Path]) -> Metadata:
    """The DCP metadata of ``folder`` (read with the allow-list unpickler)."""
    return SafeReader(folder).read_metadata()


def tensor_shapes(folder: Union[str, Path, Metadata]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Global size and dtype of every tensor stored in the DCP folder (or its metadata)."""
    metadata = folder if isinstance(folder, Metadata) else read_metadata(folder)
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out[key] = (md.size, md.properties.dtype)
    return out


def column_widths(metadata: Metadata, key: str) -> Optional[list[int]]:
    """Widths of the column chunks a 2-d tensor was saved in, left to right (None: unknown).

    Args:
        metadata: the DCP folder's metadata (:func:`read_metadata`).
        key: the tensor's flat key.
    """
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata) or len(md.size) != 2:
        return None
    starts = sorted({(int(c.offsets[1]), int(c.sizes[1])) for c in md.chunks})
    return [w for _, w in starts]


def load_whole(folder: Union[str, Path], keys: Optional[Iterable[str]] = None) -> dict[str, torch.Tensor]:
    """Read stored tensors whole, as plain CPU tensors, in this process alone.

    Sharded tables come back gathered. No collective runs, so any process may call it,
    with or without a process group.

    Args:
        folder: the DCP folder.
        keys: the flat keys to read; all tensors by default.

    Returns:
        Flat key -> tensor.
    """
    shapes = tensor_shapes(folder)
    wanted = list(shapes) if keys is None else list(keys)
    missing = [k for k in wanted if k not in shapes]
    if missing:
        raise KeyError(f"{folder}: no tensor stored under {missing[:5]}")
    out = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in wanted}
    if out:
        with one_process_quiet():
            dcp.load(out, storage_reader=SafeReader(folder), no_dist=True)
    return out


def load_into(folder: Union[str, Path], targets: dict[str, Any]) -> None:
    """Fill ``targets`` (tensors and ShardedTensors of the right global size) from the
    DCP folder (collective: every process calls it).

    A ShardedTensor receives the chunks of its local shards, whatever the sharding the
    checkpoint was written with; a plain tensor receives the whole tensor. The keys may
    differ between processes (TorchRec's fused state names only the tables a process holds).
    """
    with one_process_quiet():
        dcp.load(targets, storage_reader=SafeReader(folder), no_dist=not process_group_initialized())
