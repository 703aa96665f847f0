"""Synthetic Criteo-shaped data with a known, learnable signal.

Rows have 13 integer dense features and 26 categorical features with the Kaggle table
sizes (or given ones). The data set is cut into blocks of ``block_rows`` rows; block
``k`` is generated from its own seed ``(seed, stream, epoch, k)``, so the rows do not
depend on the number of ranks, and rank ``r`` of ``world_size`` takes blocks
``r, r + world_size, ...`` (disjoint, deterministic streams).

Categorical ids. For a table of ``n`` rows, popularity ranks ``k = 0, 1, ...`` are drawn
from a Zipf law ``P(k) ~ (k + 1) ** -s`` truncated to ``n - 1`` ranks. Sampling is by
inverse CDF: an exact CDF over the first ``head = min(n - 1, 1024)`` ranks
(``searchsorted``), and for the tail the continuous power law on ``[head + 0.5, n - 0.5]``
inverted in closed form and rounded (relative error in the tail pmf below
``s (s + 1) / (24 head^2)``, i.e. about 1e-7). Cost per draw is independent of ``n``, so
10M-row tables are as cheap as small ones. A rank maps to an id by a fixed random
affine bijection ``id = 1 + (k * a + b) mod (n - 1)`` so popular ids are spread over the
table; id 0 is reserved for a missing category.

Labels. ``p = sigmoid(bias + sum_j w_j * (d_j - m_j) / s_j + sum_f e_f[k_f])`` where
``d_j = log(1 + x_j)`` is exactly the dense input a model sees (missing -> 0), and
``e_f[k]`` is a random per-id effect for the ``head_ids`` most popular ids of table ``f``
(0 for rarer ids and for missing), which a model can only learn by memorising ids. The
best achievable AUC (that of the true ``p``) is computed by :meth:`SyntheticCriteo.bayes_auc`.

Example::

    >>> gen = SyntheticCriteo(SyntheticCriteoConfig(batch_size=4, num_rows=8))
    >>> [b.dense_features.shape[0] for b in gen]
    [4, 4]
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from torch.utils.data import IterableDataset, get_worker_info
from torchrec.datasets.utils import Batch

from comera_rec.data.criteo import (
    CAT_FEATURE_COUNT,
    CAT_NAMES,
    INT_FEATURE_COUNT,
    INT_NAMES,
    KAGGLE_NUM_EMBEDDINGS,
    LABEL_NAME,
    BatchBuffer,
    make_batch,
)
from comera_rec.data.position import Interval, PassCursor, ReadPosition
from comera_rec.data.transforms import dense_transform

logger = logging.getLogger(__name__)

_STREAMS = {"train": 0, "val": 1}
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


@dataclass
class SyntheticCriteoConfig:
    """Options of the synthetic Criteo generator.

    Example::

        cfg = SyntheticCriteoConfig(num_embeddings_per_feature=[1000] * 26, zipf_exponent=1.2)
    """

    num_embeddings_per_feature: List[int] = field(default_factory=lambda: list(KAGGLE_NUM_EMBEDDINGS))
    """Rows of each of the 26 tables; ids are in [0, n), id 0 = missing."""
    zipf_exponent: float = 1.1
    """Exponent s of the Zipf law over id popularity ranks (larger = more skewed)."""
    batch_size: int = 2048
    """Rows per batch."""
    num_rows: Optional[int] = 1 << 20
    """Rows of the whole stream (all ranks together) per epoch; None = endless."""
    seed: int = 0
    """Seed of the hidden model and of every block."""
    stream: str = "train"
    """"train" or "val": independent row streams from the same hidden model."""
    rank: int = 0
    """This process's rank (takes blocks rank, rank + world_size, ...)."""
    world_size: int = 1
    """Number of ranks."""
    block_rows: int = 8192
    """Rows per independently seeded block; the data set is the same for any world_size as
    long as num_rows >= block_rows * world_size (smaller streams use smaller blocks)."""
    drop_last: bool = False
    """Yield only full batches, the same number on every rank."""
    dense_missing_prob: float = 0.1
    """Probability that a dense value is missing (-> 0)."""
    cat_missing_prob: float = 0.02
    """Probability that a category is missing (-> id 0)."""
    head_ids: int = 2000
    """Per table, the most popular ids that carry a per-id label effect."""
    id_effect_std: float = 0.25
    """Standard deviation of the per-id effects (logit units)."""
    dense_weight_std: float = 0.25
    """Standard deviation of the dense weights (logit units per standardised feature)."""
    bias: float = -1.6
    """Logit bias (sets the click rate; about 0.29 with the defaults, Bayes AUC about 0.82)."""


class ZipfSampler:
    """Draws popularity ranks in [0, n) with P(k) ~ (k + 1) ** -s, at O(log head) per draw.

    Args:
        n: number of ranks.
        s: Zipf exponent (> 0).
        head: ranks sampled from an exact CDF; the rest from the continuous tail law.

    Example::

        >>> r = ZipfSampler(10_000_000, 1.1).sample(np.random.default_rng(0), 5)
        >>> r.shape, bool((r >= 0).all() and (r < 10_000_000).all())
        ((5,), True)
    """

    def __init__(self, n: int, s: float, head: int = 1024) -> None:
        if n < 1 or s <= 0:
            raise ValueError(f"ZipfSampler needs n >= 1 and s > 0, got n={n}, s={s}")
        self.n, self.s = n, s
        self.head = min(n, head)
        w = np.arange(1, self.head + 1, dtype=np.float64) ** -s
        self.head_cdf = np.cumsum(w)  # [head]
        self.head_mass = float(self.head_cdf[-1])
        # tail: continuous density x ** -s on [lo, hi], x = rank + 1
        self.lo, self.hi = self.head + 0.5, n + 0.5
        self.tail_mass = self._integral(self.lo, self.hi) if n > self.head else 0.0
        self.total = self.head_mass + self.tail_mass

    def _integral(self, a: float, b: float) -> float:
        if abs(self.s - 1.0) < 1e-9:
            return math.log(b / a)
        return (b ** (1 - self.s) - a ** (1 - self.s)) / (1 - self.s)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """int64 [size] ranks (0 = most popular)."""
        u = rng.random(size) * self.total
        ranks = np.searchsorted(self.head_cdf, u, side="right")  # head ranks (head for tail)
        tail = u >= self.head_mass
        if tail.any():
            v = u[tail] - self.head_mass  # mass into the tail
            if abs(self.s - 1.0) < 1e-9:
                x = self.lo * np.exp(v)
            else:
                x = (self.lo ** (1 - self.s) + v * (1 - self.s)) ** (1 / (1 - self.s))
            ranks[tail] = np.clip(np.rint(x).astype(np.int64) - 1, self.head, self.n - 1)
        return np.minimum(ranks, self.n - 1).astype(np.int64)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by ranks (ties get their average rank).

    Example::

        >>> roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
        0.75
    """
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), np.float64)
    # average ranks over runs of equal scores
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each run
    ranks[order] = np.repeat(avg, ends - starts)
    n_pos, n_neg = labels.sum(), (~labels).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def expected_auc(p: np.ndarray) -> float:
    """AUC that the true probabilities ``p`` reach in expectation over labels y ~ Bernoulli(p).

    Example::

        >>> round(expected_auc(np.array([0.5, 0.5])), 3)
        0.5
    """
    p = np.sort(np.asarray(p, np.float64))
    q = 1.0 - p
    below = np.cumsum(q) - q  # negative mass ranked below each item
    ties = 0.0  # exact ties have probability ~0 for continuous p
    num = float((p * below).sum()) + ties
    den = float(p.sum() * q.sum() - (p * q).sum())
    return num / den


class SyntheticCriteo(IterableDataset):
    """Streams synthetic Criteo batches; also writes them as Criteo TSV or our Parquet.

    Args:
        config: generator options.

    Example::

        gen = SyntheticCriteo(SyntheticCriteoConfig(seed=1, rank=0, world_size=2))
        print(gen.bayes_auc())
        batch = next(iter(gen))  # Batch: dense [2048, 13], KJT of 26 features, labels [2048]
    """

    def __init__(self, config: SyntheticCriteoConfig) -> None:
        super().__init__()
        sizes = [int(n) for n in config.num_embeddings_per_feature]
        if len(sizes) != CAT_FEATURE_COUNT or min(sizes) < 1:
            raise ValueError(f"num_embeddings_per_feature must be {CAT_FEATURE_COUNT} sizes >= 1, got {sizes}")
        if config.stream not in _STREAMS:
            raise ValueError(f"stream must be one of {list(_STREAMS)}, got {config.stream!r}")
        if not 0 <= config.rank < config.world_size:
            raise ValueError(f"rank must be in [0, world_size={config.world_size}), got {config.rank}")
        self.config = config
        self.sizes = sizes
        self.epoch = 0
        self._cursor: Optional[PassCursor] = None  # the current pass (for position())
        self._resume: Optional[ReadPosition] = None  # what the next pass generates instead of the plan
        # hidden model: identical on every rank and stream for a given seed
        rng = np.random.default_rng(np.random.SeedSequence([config.seed, 7919]))
        self.dense_mu = rng.uniform(0.5, 4.0, INT_FEATURE_COUNT)  # log-scale location of counts
        self.dense_sigma = rng.uniform(0.5, 1.5, INT_FEATURE_COUNT)
        self.dense_w = rng.normal(0.0, config.dense_weight_std, INT_FEATURE_COUNT)
        self.samplers, self.id_mult, self.id_shift, self.effects = [], [], [], []
        for n in sizes:
            m = max(n - 1, 1)  # ranks 0..m-1 map to ids 1..m (id 0 = missing)
            self.samplers.append(ZipfSampler(m, config.zipf_exponent))
            a = int(rng.integers(1, 1 << 30)) | 1
            while math.gcd(a, m) != 1:
                a += 2
            self.id_mult.append(a)
            self.id_shift.append(int(rng.integers(0, m)))
            self.effects.append(rng.normal(0.0, config.id_effect_std, min(config.head_ids, m)))

    def set_epoch(self, epoch: int) -> None:
        """Use fresh training rows for ``epoch`` (the val stream ignores it)."""
        self.epoch = epoch

    # -- generation ---------------------------------------------------------------------
    def generate_block(self, block: int, rows: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Raw rows of block ``block``.

        Returns:
            dict with ``labels`` int64 [n], ``prob`` float64 [n] (true click probability),
            ``dense_raw`` int64 [n, 13] (counts), ``dense_missing`` bool [n, 13],
            ``ids`` int64 [n, 26] (0 = missing), ``dense`` float32 [n, 13] (model input).
        """
        cfg = self.config
        n = cfg.block_rows if rows is None else rows
        epoch = self.epoch if cfg.stream == "train" else 0
        rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, _STREAMS[cfg.stream], epoch, block]))
        z = rng.standard_normal((n, INT_FEATURE_COUNT))  # [n, 13]
        dense_raw = np.maximum(np.floor(np.expm1(self.dense_mu + self.dense_sigma * z)), 0).astype(np.int64)
        dense_missing = rng.random((n, INT_FEATURE_COUNT)) < cfg.dense_missing_prob
        dense_raw[dense_missing] = 0
        dense = dense_transform(dense_raw)  # [n, 13] exactly what a reader yields
        logit = cfg.bias + ((dense - self.dense_mu) / self.dense_sigma) @ self.dense_w  # [n]
        ids = np.empty((n, CAT_FEATURE_COUNT), np.int64)
        cat_missing = rng.random((n, CAT_FEATURE_COUNT)) < cfg.cat_missing_prob
        for f, (sampler, eff) in enumerate(zip(self.samplers, self.effects)):
            k = sampler.sample(rng, n)  # popularity ranks [n]
            e = np.where(k < len(eff), eff[np.minimum(k, len(eff) - 1)], 0.0)
            logit += np.where(cat_missing[:, f], 0.0, e)
            m = max(self.sizes[f] - 1, 1)
            ids[:, f] = 1 + (k * self.id_mult[f] + self.id_shift[f]) % m if self.sizes[f] > 1 else 0
        ids[cat_missing] = 0
        prob = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < prob).astype(np.int64)
        return {
            "labels": labels,
            "prob": prob,
            "dense_raw": dense_raw,
            "dense_missing": dense_missing,
            "ids": ids,
            "dense": dense,
        }

    def _shard(self) -> Tuple[int, int]:
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.config.rank * workers + wid, self.config.world_size * workers

    def _block_rows(self, num_shards: int) -> int:
        """Rows per block: block_rows, made smaller when a finite stream would leave shards empty."""
        cfg = self.config
        if cfg.num_rows is None:
            return cfg.block_rows
        return max(1, min(cfg.block_rows, cfg.num_rows // num_shards))

    def _blocks(self, shard: int, num_shards: int) -> Iterator[Tuple[int, int]]:
        """(block index, rows) of this shard's blocks."""
        cfg = self.config
        size = self._block_rows(num_shards)
        k = shard
        while cfg.num_rows is None or k * size < cfg.num_rows:
            yield k, self._rows_of_block(k, size)
            k += num_shards

    def rows_per_shard(self, num_shards: int) -> List[int]:
        """Rows each of ``num_shards`` shards receives (finite streams only)."""
        return [sum(r for _, r in self._blocks(s, num_shards)) for s in range(num_shards)]

    def _rows_of_block(self, block: int, size: int) -> int:
        cfg = self.config
        return size if cfg.num_rows is None else min(size, cfg.num_rows - block * size)

    def _whole_pass(self, shard: int, num_shards: int) -> ReadPosition:
        """The rows of this shard's full pass (finite streams) as a position with nothing read."""
        cfg = self.config
        size = self._block_rows(num_shards)
        cap = min(self.rows_per_shard(num_shards)) // cfg.batch_size if cfg.drop_last else None
        blocks = [(k * size, k * size + rows) for k, rows in self._blocks(shard, num_shards)]
        return ReadPosition(blocks, cap, {"block_rows": size})

    def position(self) -> Optional[ReadPosition]:
        """What this stream has left of its current pass after the last batch it yielded:
        global rows ``block * block_rows + offset`` (before a pass: all of the next one; None
        for an endless stream, which has no end to re-split)."""
        cfg = self.config
        if cfg.num_rows is None:
            return None
        if self._cursor is None:
            return self._resume if self._resume is not None else self._whole_pass(*self._shard())
        return self._cursor.position()

    def resume(self, position: ReadPosition) -> None:
        """Generate only ``position``'s rows in the next pass (blocks of its ``block_rows``).

        Args:
            position: e.g. :func:`comera_rec.data.position.resume_position` of a checkpoint's.
        """
        if "block_rows" not in position.layout:
            raise ValueError("a synthetic stream's data position needs its layout's block_rows")
        self._resume = position

    def _pieces(self, intervals: List[Interval], size: int) -> Iterator[Tuple[int, int, int]]:
        """(block, first, stop) offsets within blocks of ``size`` rows, for global row intervals."""
        for lo, hi in intervals:
            for k in range(lo // size, (hi - 1) // size + 1):
                yield k, max(lo - k * size, 0), min(hi - k * size, size)

    def __iter__(self) -> Iterator[Batch]:
        cfg = self.config
        shard, num_shards = self._shard()
        resume, self._resume = self._resume, None
        if resume is not None:
            if get_worker_info() is not None:
                raise RuntimeError("a resumed data position cannot be split over DataLoader workers (num_workers=0)")
            size, max_batches = resume.layout["block_rows"], resume.batches_left
            pieces = self._pieces(resume.remaining, size)
            plan: object = list(resume.remaining)
        else:
            size = self._block_rows(num_shards)
            max_batches = None
            if cfg.drop_last and cfg.num_rows is not None:
                max_batches = min(self.rows_per_shard(num_shards)) // cfg.batch_size
            pieces = ((k, 0, rows) for k, rows in self._blocks(shard, num_shards))
            plan = lambda: self._whole_pass(shard, num_shards).remaining  # noqa: E731 (asked only for a position)
        cursor = self._cursor = PassCursor(plan, max_batches, {"block_rows": size})
        buf = BatchBuffer(cfg.batch_size)
        for k, a, b in pieces:
            blk = self.generate_block(k, self._rows_of_block(k, size))  # the whole block: its rows depend on it
            rows = k * size + np.arange(a, b)
            for d, s, y, r in buf.add(blk["dense"][a:b], blk["ids"][a:b], blk["labels"][a:b].astype(np.float32), rows):
                if max_batches is not None and cursor.emitted >= max_batches:
                    return
                cursor.yielded(int(r[-1]))
                yield make_batch(d, s, y)
        if not cfg.drop_last:
            for d, s, y, r in buf.flush():
                cursor.yielded(int(r[-1]))
                yield make_batch(d, s, y)

    def bayes_auc(self, rows: int = 1 << 17) -> float:
        """Best achievable AUC: expected AUC of the true probabilities on ``rows`` val rows.

        Example::

            >>> round(SyntheticCriteo(SyntheticCriteoConfig()).bayes_auc(), 2)  # doctest: +SKIP
            0.82
        """
        gen = SyntheticCriteo(replace(self.config, stream="val"))
        probs, k = [], 0
        while sum(len(p) for p in probs) < rows:
            probs.append(gen.generate_block(k, min(self.config.block_rows, rows - k * self.config.block_rows))["prob"])
            k += 1
        return expected_auc(np.concatenate(probs))

    # -- writers ------------------------------------------------------------------------
    def _tables(self, num_rows: int, with_label: bool = True) -> Iterator[Tuple[pa.Table, pa.Table]]:
        """(TSV-shaped table, Parquet-shaped table) per block over the whole stream."""
        k = 0
        while k * self.config.block_rows < num_rows:
            blk = self.generate_block(k, min(self.config.block_rows, num_rows - k * self.config.block_rows))
            k += 1
            n = len(blk["labels"])
            tsv_cols, pq_cols, names = [], [], []
            if with_label:
                names.append(LABEL_NAME)
                tsv_cols.append(pa.array(blk["labels"]))
                pq_cols.append(pa.array(blk["labels"].astype(np.int8)))
            for j, name in enumerate(INT_NAMES):
                col = pa.array(blk["dense_raw"][:, j], mask=blk["dense_missing"][:, j])
                names.append(name)
                tsv_cols.append(col)
                pq_cols.append(col)
            for j, name in enumerate(CAT_NAMES):
                ids = blk["ids"][:, j]
                missing = ids == 0
                # 8 lowercase hex digits per id: nibbles [n, 8] -> ascii bytes -> 'S8' strings
                nib = (ids[:, None] >> (4 * np.arange(7, -1, -1))[None, :]) & 15
                hexs = np.ascontiguousarray(_HEX_DIGITS[nib]).view("S8").reshape(n)
                names.append(name)
                tsv_cols.append(pa.array(hexs, type=pa.string(), mask=missing))
                pq_cols.append(pa.array(ids, mask=missing))
            yield pa.table(tsv_cols, names=names), pa.table(pq_cols, names=names)

    def write_tsv(self, path: str | Path, num_rows: int, with_label: bool = True) -> Path:
        """Write ``num_rows`` rows of this stream as Criteo TSV (gzip if the name ends in .gz).

        Dense values are written as integers (empty = missing), categories as 8-digit hex
        (empty = missing), so reading the file back gives the same batches.

        Example::

            SyntheticCriteo(SyntheticCriteoConfig()).write_tsv("/tmp/synth.tsv", 200_000)
        """
        path = Path(path)
        opts = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
        sink = pa.CompressedOutputStream(str(path), "gzip") if path.suffix == ".gz" else pa.OSFile(str(path), "wb")
        with sink:
            for tsv, _ in self._tables(num_rows, with_label):
                pacsv.write_csv(tsv, sink, opts)
        return path

    def write_parquet(self, path: str | Path, num_rows: int) -> Path:
        """Write ``num_rows`` rows in the Parquet layout of ``data/preprocess_criteo.py`` (raw ids)."""
        path = Path(path)
        writer = None
        for _, table in self._tables(num_rows):
            if writer is None:
                writer = pq.ParquetWriter(str(path), table.schema)
            writer.write_table(table)
        if writer is not None:
            writer.close()
        return path
