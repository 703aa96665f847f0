"""The reader of TorchRec's preprocessed npy layout (``*_dense.npy``, ``*_sparse.npy``,
``*_labels.npy``) (re-exported by :mod:`comera_rec.data.readers`)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import numpy as np

from comera_rec.data.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from comera_rec.data.reader_base import BadInputError, CriteoReaderBase, CriteoReaderConfig, NumberedChunk
from comera_rec.data.transforms import dense_transform


def load_npy(path: Path) -> np.ndarray:
    """Memory-map a numeric .npy array; never unpickles (a file of Python objects is an error)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise BadInputError(
            f"{path}: not a numeric .npy array ({e}); files holding pickled Python objects "
            "are never loaded (allow_pickle=False)"
        ) from e
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise BadInputError(f"{path}: dtype {getattr(arr, 'dtype', type(arr).__name__)}, expected a numeric array")
    return arr


class CriteoNpyReader(CriteoReaderBase):
    """Reader for TorchRec's preprocessed layout: ``X_dense.npy``, ``X_sparse.npy``, ``X_labels.npy``.

    ``paths`` name the ``*_dense.npy`` files; the sparse and label files are found beside
    them. Arrays are memory-mapped and read ``chunk_rows`` rows at a time. Dense values
    are taken as they are (TorchRec stored them log-transformed) unless
    ``dense_is_transformed=False``, in which case our dense transform is applied. Sparse
    ids cannot tell missing from raw id 0.

    Args:
        config: reader options.

    Example::

        reader = CriteoNpyReader(CriteoReaderConfig(paths=[f"day_{d}_dense.npy" for d in range(24)],
                                 split="test", holdout="last_file",
                                 num_embeddings_per_feature=TERABYTE_NUM_EMBEDDINGS))
    """

    def __init__(self, config: CriteoReaderConfig) -> None:
        for p in config.paths:
            if not str(p).endswith("_dense.npy"):
                raise ValueError(f"npy reader paths must be '*_dense.npy' files, got {p}")
        super().__init__(config)

    def _triplet(self, path: Path) -> Tuple[Path, Path, Path]:
        stem = str(path)[: -len("_dense.npy")]
        return path, Path(stem + "_sparse.npy"), Path(stem + "_labels.npy")

    def _all_paths(self) -> List[Path]:
        return [q for p in self.paths for q in self._triplet(p)]

    def _load(self, path: Path) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Memory-map and check one triplet: shapes [N, 13], [N, 26], [N] or [N, 1], one N."""
        dense_p, sparse_p, labels_p = self._triplet(path)
        dense, sparse, labels = (load_npy(q) for q in (dense_p, sparse_p, labels_p))
        for q, a, width, what in (
            (dense_p, dense, INT_FEATURE_COUNT, "dense features"),
            (sparse_p, sparse, CAT_FEATURE_COUNT, "category ids"),
        ):
            if a.ndim != 2 or a.shape[1] != width:
                raise BadInputError(f"{q}: shape {list(a.shape)}, expected [N, {width}] ({what}, one row per sample)")
        if not (labels.ndim == 1 or (labels.ndim == 2 and labels.shape[1] == 1)):
            raise BadInputError(
                f"{labels_p}: shape {list(labels.shape)}, expected [N] or [N, 1] (one label per row; "
                f"{dense_p.name} has N = {len(dense)})"
            )
        if not len(dense) == len(sparse) == len(labels):
            raise BadInputError(
                f"row counts differ: {dense_p} has {len(dense)} rows, {sparse_p} {len(sparse)}, "
                f"{labels_p} {len(labels)}; the three files of a day must hold the same rows"
            )
        return dense, sparse, labels

    def _count_file_rows(self) -> List[int]:
        return [len(self._load(p)[0]) for p in self.paths]

    def _read_range(self, file_idx: int, lo: int, hi: Optional[int]) -> Iterator[NumberedChunk]:
        dense_p = self.paths[file_idx]
        dense, sparse, labels = self._load(dense_p)
        hi = len(dense) if hi is None else hi
        if len(dense) == 0 and self._file_rows_cache is None:
            self._empty_file(dense_p)
        for a in range(lo, hi, self.config.chunk_rows):
            b = min(a + self.config.chunk_rows, hi)
            d = np.asarray(dense[a:b])
            d = d.astype(np.float32) if self.config.dense_is_transformed else dense_transform(d.astype(np.int64))
            s = np.asarray(sparse[a:b]).astype(np.int64)
            yield (
                np.arange(a, b),
                (np.asarray(labels[a:b]).reshape(-1).astype(np.float32), d, s, np.zeros(s.shape, bool)),
            )
