"""Feature transforms: dense log transform, hex parsing, hashing, contiguous vocabularies.

Dense features: ``log(1 + max(x, 0))`` with missing -> 0 (so missing and 0 coincide).
This is the DLRM reference script's transform. TorchRec's ``tsv_to_npys`` instead maps
missing to 0, subtracts the minimum of the whole dense array of that file (one scalar
over all 13 columns) minus 2 and takes the log, i.e. ``log(x - m + 2)``. We do not follow
it because ``m`` is a whole-file statistic: a streaming reader cannot know it before the
file has been read, it differs from file to file (so the same raw value maps to
different inputs in different days), and it makes missing (0) land on a different value
per file. Ours is stateless and identical on every rank and every file; the cost is that
the rare negative values (only in I2, down to -3 in Kaggle) collapse onto 0.

Categorical features: 32-bit hex -> int (missing -> raw 0, as TorchRec does), then one of
  - ``"hash"``: ``raw % num_embeddings[f]`` (missing lands in bucket 0 with raw id 0),
  - ``"vocab"``: contiguous remap through a vocabulary built with a frequency threshold:
    id 0 = missing, id 1 = rare or unseen (the shared bucket), ids 2.. = kept raw ids in
    ascending raw order; the table size is ``len(vocab) + 2``,
  - ``"identity"``: ids passed through (e.g. npy files that are already contiguous).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from comera_rec.data.criteo import CAT_FEATURE_COUNT, CAT_NAMES

MISSING_ID = 0  # vocab mode: missing category
RARE_ID = 1  # vocab mode: category seen fewer than frequency_threshold times, or unseen
NUM_RESERVED_IDS = 2
TABLE_SIZES_FILE = "table_sizes.json"
VOCAB_DIR = "vocab"

# byte -> hex nibble; 255 marks a byte that is not a hex digit
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i


def dense_transform(raw: np.ndarray) -> np.ndarray:
    """log(1 + max(x, 0)) of raw integer dense features (missing already set to 0).

    Args:
        raw: int64 [N, 13] raw counts, missing = 0.

    Returns:
        float32 [N, 13].

    Example::

        >>> np.allclose(dense_transform(np.array([[0, 1, -3]])), [[0.0, np.log(2.0), 0.0]])
        True
    """
    return np.log1p(np.maximum(raw, 0).astype(np.float64)).astype(np.float32)


def _string_buffers(arr: pa.Array) -> Tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [N + 1], data uint8) of an Arrow string array, zero copy where possible."""
    if arr.type == pa.large_string():
        off_dtype, width = np.int64, 8
    else:
        off_dtype, width = np.int32, 4
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_dtype, count=len(arr) + 1, offset=arr.offset * width)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and bufs[2].size else np.zeros(1, np.uint8)
    return offsets.astype(np.int64), data


def parse_hex(arr: pa.Array) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised parse of an Arrow string column of 32-bit hex categories.

    Args:
        arr: Arrow string array (or chunked array) of N values; "" or null = missing.

    Returns:
        (raw int64 [N] with missing -> 0, missing bool [N], bad bool [N]); a value is bad
        if it has more than 8 characters or a character that is not a hex digit.

    Example::

        >>> raw, missing, bad = parse_hex(pa.array(["ff", "", "zz"]))
        >>> raw.tolist(), missing.tolist(), bad.tolist()
        ([255, 0, 0], [False, True, False], [False, False, True])
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if arr.type not in (pa.string(), pa.large_string()):
        arr = arr.cast(pa.string())
    n = len(arr)
    offsets, data = _string_buffers(arr)
    starts = offsets[:-1]
    lens = offsets[1:] - starts  # [N]
    missing = lens == 0
    if arr.null_count:
        missing |= np.asarray(arr.is_null().to_numpy(zero_copy_only=False))
        lens = np.where(missing, 0, lens)
    if ((lens == 8) | (lens == 0)).all() and len(lens) and (offsets[-1] - offsets[0]) == 8 * int((lens == 8).sum()):
        # common Criteo case: every value is 8 hex digits or empty, so the present values
        # are consecutive 8-byte runs of the data buffer -> [K, 8] without a gather
        raw = np.zeros(n, np.int64)
        nib = _HEX_LUT[data[offsets[0] : offsets[-1]]].reshape(-1, 8)  # [K, 8]
        present = ~missing
        bad = np.zeros(n, bool)
        bad[present] = (nib == 255).any(axis=1)
        packed = (nib[:, 0::2] << 4) | nib[:, 1::2]  # [K, 4] bytes, big-endian order
        raw[present] = np.ascontiguousarray(packed).view(">u4").reshape(-1).astype(np.int64)
        raw[bad] = 0
        return raw, missing, bad
    bad = lens > 8
    lens8 = np.minimum(lens, 8)
    pos = np.arange(8)
    valid = pos[None, :] < lens8[:, None]  # [N, 8]
    idx = np.where(valid, starts[:, None] + pos[None, :], 0)
    nib = _HEX_LUT[data[idx]]  # [N, 8]
    bad |= ((nib == 255) & valid).any(axis=1)
    nib = np.where(valid & (nib != 255), nib, 0).astype(np.int64)
    shift = np.where(valid, 4 * (lens8[:, None] - 1 - pos[None, :]), 0)
    raw = (nib << shift).sum(axis=1)
    raw[bad | missing] = 0
    return raw.astype(np.int64), missing, bad


@dataclass
class CategoricalTransform:
    """Maps raw categorical ids [N, 26] to embedding-table rows [N, 26].

    Example::

        >>> t = CategoricalTransform.hashing([10] * 26)
        >>> t(np.full((1, 26), 123), np.zeros((1, 26), bool))[0, :3].tolist()
        [3, 3, 3]
    """

    mode: str = "identity"
    """"hash" (modulo num_embeddings), "vocab" (contiguous remap) or "identity"."""
    num_embeddings: Optional[List[int]] = None
    """Rows per table; for "vocab" it is len(vocab) + 2."""
    vocabs: Optional[List[np.ndarray]] = None
    """"vocab" mode: per feature, the sorted raw ids that get their own row."""

    @staticmethod
    def hashing(num_embeddings: Sequence[int]) -> "CategoricalTransform":
        """Modulo hashing into ``num_embeddings[f]`` rows per feature."""
        sizes = [int(s) for s in num_embeddings]
        if len(sizes) != CAT_FEATURE_COUNT or min(sizes) <= 0:
            raise ValueError(f"num_embeddings must be {CAT_FEATURE_COUNT} positive sizes, got {sizes}")
        return CategoricalTransform("hash", sizes)

    @staticmethod
    def from_vocab_dir(directory: str | Path) -> "CategoricalTransform":
        """Contiguous remap from the vocabularies written by the preprocessing command."""
        vocabs = load_vocabularies(directory)
        return CategoricalTransform("vocab", [len(v) + NUM_RESERVED_IDS for v in vocabs], vocabs)

    def __call__(self, raw: np.ndarray, missing: np.ndarray) -> np.ndarray:
        """Args: raw int64 [N, 26] (missing = 0), missing bool [N, 26]. Returns int64 [N, 26]."""
        if self.mode == "identity":
            return raw.astype(np.int64, copy=False)
        if self.mode == "hash":
            return raw % np.asarray(self.num_embeddings, dtype=np.int64)[None, :]
        if self.mode != "vocab":
            raise ValueError(f"unknown categorical transform mode {self.mode!r}")
        out = np.empty(raw.shape, dtype=np.int64)
        for f, vocab in enumerate(self.vocabs):  # type: ignore[arg-type]
            col = raw[:, f]
            pos = np.searchsorted(vocab, col)
            found = vocab[np.minimum(pos, len(vocab) - 1)] == col if len(vocab) else np.zeros(len(col), bool)
            out[:, f] = np.where(found, pos + NUM_RESERVED_IDS, RARE_ID)
        out[missing] = MISSING_ID
        return out


class IdCounter:
    """Streaming per-feature id frequency counter (numpy, no Python dict per id).

    Chunks are reduced with ``np.unique`` and merged into a sorted (ids, counts) table
    when the pending part grows as large as the table, so the total cost is
    O(N log N) and memory is about 16 bytes per distinct id.

    Args:
        num_features: number of categorical features.

    Example::

        >>> c = IdCounter(1)
        >>> c.add(np.array([[5], [5], [7]]), np.zeros((3, 1), bool))
        >>> ids, counts = c.result(0); ids.tolist(), counts.tolist()
        ([5, 7], [2, 1])
    """

    def __init__(self, num_features: int = CAT_FEATURE_COUNT) -> None:
        self.num_features = num_features
        self._ids = [np.zeros(0, np.int64) for _ in range(num_features)]
        self._counts = [np.zeros(0, np.int64) for _ in range(num_features)]
        self._pending: List[List[Tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_features)]
        self._pending_size = [0] * num_features

    def add(self, raw: np.ndarray, missing: np.ndarray) -> None:
        """Count a chunk. Args: raw int64 [N, F], missing bool [N, F] (not counted)."""
        for f in range(self.num_features):
            ids, counts = np.unique(raw[~missing[:, f], f], return_counts=True)
            self._pending[f].append((ids, counts))
            self._pending_size[f] += len(ids)
            if self._pending_size[f] >= max(len(self._ids[f]), 1 << 20):
                self._merge(f)

    def _merge(self, f: int) -> None:
        parts = [(self._ids[f], self._counts[f])] + self._pending[f]
        ids = np.concatenate([p[0] for p in parts])
        counts = np.concatenate([p[1] for p in parts])
        uniq, inv = np.unique(ids, return_inverse=True)
        self._ids[f] = uniq
        self._counts[f] = np.bincount(inv, weights=counts, minlength=len(uniq)).astype(np.int64)
        self._pending[f], self._pending_size[f] = [], 0

    def result(self, f: int) -> Tuple[np.ndarray, np.ndarray]:
        """(sorted distinct ids, counts) of feature ``f``."""
        if self._pending[f]:
            self._merge(f)
        return self._ids[f], self._counts[f]

    def vocabularies(self, frequency_threshold: int) -> List[np.ndarray]:
        """Per feature, the sorted ids seen at least ``frequency_threshold`` times."""
        out = []
        for f in range(self.num_features):
            ids, counts = self.result(f)
            out.append(ids[counts >= frequency_threshold])
        return out


def save_vocabularies(
    directory: str | Path, vocabs: List[np.ndarray], frequency_threshold: int, extra: Optional[Dict] = None
) -> Dict:
    """Write ``vocab/cat_{f}.npy`` and ``table_sizes.json`` under ``directory``.

    ``table_sizes.json`` holds ``num_embeddings_per_feature`` (len(vocab) + 2 per feature,
    in ``cat_0 .. cat_25`` order) for the model config, plus the id policy.

    Returns:
        the JSON content as a dict.
    """
    directory = Path(directory)
    (directory / VOCAB_DIR).mkdir(parents=True, exist_ok=True)
    for name, vocab in zip(CAT_NAMES, vocabs):
        np.save(directory / VOCAB_DIR / f"{name}.npy", vocab.astype(np.int64))
    meta = {
        "num_embeddings_per_feature": [int(len(v) + NUM_RESERVED_IDS) for v in vocabs],
        "feature_names": CAT_NAMES,
        "frequency_threshold": int(frequency_threshold),
        "id_policy": "0 = missing, 1 = rare (count < frequency_threshold) or unseen, 2.. = kept raw ids in ascending order",
    }
    meta.update(extra or {})
    (directory / TABLE_SIZES_FILE).write_text(json.dumps(meta, indent=1))
    return meta


def load_vocabularies(directory: str | Path) -> List[np.ndarray]:
    """Read the 26 vocabularies written by :func:`save_vocabularies`."""
    directory = Path(directory)
    vocab_dir = directory / VOCAB_DIR
    if not vocab_dir.is_dir():
        raise FileNotFoundError(f"no vocabulary folder {vocab_dir} (run data/preprocess_criteo.py first)")
    return [np.load(vocab_dir / f"{name}.npy") for name in CAT_NAMES]


def load_table_sizes(directory: str | Path) -> List[int]:
    """``num_embeddings_per_feature`` from ``directory/table_sizes.json``.

    Example::

        sizes = load_table_sizes("/data/criteo_parquet")  # -> 26 ints for the model config
    """
    path = Path(directory) / TABLE_SIZES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no table sizes file {path} (run data/preprocess_criteo.py first)")
    return [int(s) for s in json.loads(path.read_text())["num_embeddings_per_feature"]]
