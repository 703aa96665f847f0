"""Criteo constants, splits, rank sharding and the Batch builder.

Every reader and the synthetic generator end in :func:`make_batch`, so they all hand
the trainer the same thing: a ``torchrec.datasets.utils.Batch`` with

- ``dense_features``: float32 [B, 13], already transformed (log(1 + max(x, 0))),
- ``sparse_features``: a ``KeyedJaggedTensor`` with the 26 keys ``cat_0 .. cat_25``,
  exactly one id per feature per row (all lengths 1), values int64,
- ``labels``: float32 [B] (0 / 1; -1 where the source has no label, e.g. Kaggle test.txt).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
INT_NAMES: List[str] = list(DEFAULT_INT_NAMES)  # "int_0" .. "int_12"
CAT_NAMES: List[str] = list(DEFAULT_CAT_NAMES)  # "cat_0" .. "cat_25"
LABEL_NAME = "label"
TSV_COLUMNS_WITH_LABEL = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT  # 40
TSV_COLUMNS_WITHOUT_LABEL = INT_FEATURE_COUNT + CAT_FEATURE_COUNT  # 39 (Kaggle test.txt)
NO_LABEL = -1.0  # label given to rows of files without a label column

# Distinct ids per feature in Kaggle train.txt (DLRM reference configuration).
KAGGLE_NUM_EMBEDDINGS: List[int] = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
# MLPerf DLRM-DCNv2 table sizes for Criteo Terabyte (ids hashed / capped at 40M).
TERABYTE_NUM_EMBEDDINGS: List[int] = [
    40000000,
    39060,
    17295,
    7424,
    20265,
    3,
    7122,
    1543,
    63,
    40000000,
    3067956,
    405282,
    10,
    2209,
    11938,
    155,
    4,
    976,
    14,
    40000000,
    40000000,
    40000000,
    590152,
    12973,
    108,
    36,
]
KAGGLE_TRAIN_ROWS = 45_840_617  # rows of Kaggle train.txt
KAGGLE_DAYS = 7  # Kaggle train.txt spans 7 days; the last seventh is held out
TERABYTE_DAYS = 24  # day_0 .. day_23; day_23 is held out

SPLITS = ("train", "val", "test", "all")
HOLDOUTS = ("kaggle", "last_file", "none")


def split_row_range(total_rows: int, file_rows: Sequence[int], split: str, holdout: str) -> Tuple[int, int]:
    """Global row range [start, stop) of a split over the concatenated input files.

    Schemes:
      - ``"kaggle"``: the last seventh of the rows (the last day of train.txt) is held
        out; ``val`` is its first half (rounded up), ``test`` its second half, ``train``
        everything before it. Day sizes follow the DLRM reference: ``total // 7`` rows
        per day, the ``total % 7`` extra rows going to the first days, so the held-out
        day has exactly ``total // 7`` rows.
      - ``"last_file"``: Terabyte style; the last file (day_23) is held out and split in
        halves the same way; ``train`` is every file before it.
      - ``"none"``: no hold-out; ``train`` and ``all`` are every row, val/test are errors.

    Args:
        total_rows: rows over all files.
        file_rows: rows per file, in order (used by ``"last_file"``).
        split: "train" | "val" | "test" | "all".
        holdout: "kaggle" | "last_file" | "none".

    Returns:
        (start, stop) global row indices.

    Example::

        >>> split_row_range(70, [70], "val", "kaggle")
        (60, 65)
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if holdout not in HOLDOUTS:
        raise ValueError(f"holdout must be one of {HOLDOUTS}, got {holdout!r}")
    if split == "all":
        return 0, total_rows
    if holdout == "none":
        if split != "train":
            raise ValueError(f"split {split!r} needs a hold-out scheme, got holdout='none'")
        return 0, total_rows
    if holdout == "kaggle":
        held = total_rows // KAGGLE_DAYS
    else:
        if len(file_rows) < 2 and split == "train":
            raise ValueError("holdout='last_file' needs at least 2 files to leave rows for training")
        held = int(file_rows[-1])
    held_start = total_rows - held
    half = (held + 1) // 2
    if split == "train":
        return 0, held_start
    if split == "val":
        return held_start, held_start + half
    return held_start + half, total_rows


def shard_range(start: int, stop: int, shard: int, num_shards: int) -> Tuple[int, int]:
    """Contiguous part ``shard`` of [start, stop) split into ``num_shards`` parts.

    Part sizes differ by at most one row; the parts cover every row exactly once.

    Args:
        start: first row (inclusive).
        stop: last row (exclusive).
        shard: this part's index, 0 <= shard < num_shards (e.g. the torchrun rank).
        num_shards: number of parts (e.g. the world size).

    Example::

        >>> [shard_range(0, 10, r, 3) for r in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
    n = stop - start
    return start + shard * n // num_shards, start + (shard + 1) * n // num_shards


def make_batch(dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> Batch:
    """Build a TorchRec ``Batch`` from row-major numpy arrays.

    Args:
        dense: float32 [B, 13], transformed dense features.
        sparse: int64 [B, 26], one id per feature per row (already hashed / remapped).
        labels: float32 [B].

    Example::

        >>> b = make_batch(np.zeros((2, 13), np.float32), np.zeros((2, 26), np.int64),
        ...                np.zeros(2, np.float32))
        >>> b.sparse_features.keys()[:2], b.dense_features.shape
        (['cat_0', 'cat_1'], torch.Size([2, 13]))
    """
    B = dense.shape[0]
    # KJT values are feature-major: all of cat_0's B ids, then cat_1's, ... -> [26 * B]
    values = torch.from_numpy(np.ascontiguousarray(sparse.T, dtype=np.int64).reshape(-1))
    kjt = KeyedJaggedTensor(
        keys=CAT_NAMES,
        values=values,
        lengths=torch.from_numpy(np.ones(CAT_FEATURE_COUNT * B, dtype=np.int32)),  # torch.ones is slower here
        stride=B,
        length_per_key=[B] * CAT_FEATURE_COUNT,
        offset_per_key=[B * i for i in range(CAT_FEATURE_COUNT + 1)],
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
    )


class BatchBuffer:
    """Collects row chunks of any size and cuts them into batches of ``batch_size`` rows.

    Each chunk is a tuple of row-aligned arrays (dense, sparse, labels, and e.g. the rows'
    numbers); batches come out as tuples of the same arrays. Memory stays at most one batch
    plus one chunk.

    Args:
        batch_size: rows per emitted batch.

    Example::

        >>> buf = BatchBuffer(4)
        >>> out = buf.add(np.zeros((6, 13), np.float32), np.zeros((6, 26), np.int64),
        ...               np.zeros(6, np.float32))
        >>> [b[0].shape[0] for b in out], buf.num_rows
        ([4], 2)
    """

    def __init__(self, batch_size: int) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self._parts: List[Tuple[np.ndarray, ...]] = []
        self.num_rows = 0

    def add(self, *arrays: np.ndarray) -> List[Tuple[np.ndarray, ...]]:
        """Append a chunk (arrays with the same first dimension); return the full batches now available."""
        n = len(arrays[-1])
        if n:
            self._parts.append(arrays)
            self.num_rows += n
        out: List[Tuple[np.ndarray, ...]] = []
        if self.num_rows < self.batch_size:
            return out
        cols = self._concat()
        n_full = self.num_rows // self.batch_size * self.batch_size
        for i in range(0, n_full, self.batch_size):
            out.append(tuple(c[i : i + self.batch_size] for c in cols))
        self._parts = [tuple(c[n_full:] for c in cols)] if n_full < self.num_rows else []
        self.num_rows -= n_full
        return out

    def flush(self) -> List[Tuple[np.ndarray, ...]]:
        """Return the remaining partial batch (if any) and empty the buffer."""
        if self.num_rows == 0:
            return []
        out = [self._concat()]
        self._parts, self.num_rows = [], 0
        return out

    def _concat(self) -> Tuple[np.ndarray, ...]:
        if len(self._parts) == 1:
            return self._parts[0]
        return tuple(np.concatenate([p[k] for p in self._parts]) for k in range(len(self._parts[0])))
