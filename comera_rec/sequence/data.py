"""Item sequences for the masked-item model: a synthetic generator, an interaction-file
reader, the leave-one-out split and deterministic batches.

* :func:`markov_sessions` draws sessions from a hidden first-order Markov chain over the
  items (:class:`MarkovChain`): each item has a few successors with falling
  probabilities, plus uniform noise. The next item depends on the last one only, so the
  Bayes-optimal ranking is the chain's row and the best achievable hit rate / NDCG at k
  are known exactly (:meth:`MarkovChain.best_hit_rate`, :meth:`MarkovChain.best_ndcg`).
* :func:`read_interactions` reads MovieLens-style files (user, item, timestamp; CSV, TSV,
  ``::``-separated ``ratings.dat`` or Parquet) into per-user sequences sorted by time,
  with item ids remapped to ``0..V-1``; a bad line raises a ``ValueError`` naming the file
  and the line.
* :func:`leave_one_out` splits each sequence: all but the last two items train, the
  second-to-last is the validation target, the last the test target.
* :class:`Sequences` holds jagged sequences and yields the model's batches; it, the batch
  generators and the split are in :mod:`.sequences`, and importable from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from comera_rec.sequence.sequences import (  # the jagged sequences, importable from here too
    Sequences,
    SequenceSplits,
    evaluation_batches,
    leave_one_out,
    training_batches,
)

__all__ = [
    "Interactions",
    "MarkovChain",
    "Sequences",
    "SequenceSplits",
    "evaluation_batches",
    "leave_one_out",
    "markov_sessions",
    "read_interactions",
    "training_batches",
]

# ----------------------------------------------------------------------------- synthetic sessions


def _distinct_successors(rows: int, num_items: int, branching: int, rng: np.random.Generator) -> np.ndarray:
    """``(rows, branching)`` int64: each row ``branching`` distinct items drawn uniformly."""
    if num_items <= 4096:  # one shuffle per row, drawn at once
        return np.argsort(rng.random((rows, num_items)), axis=1)[:, :branching].astype(np.int64)
    return np.stack([rng.choice(num_items, branching, replace=False) for _ in range(rows)]).astype(np.int64)


@dataclass
class MarkovChain:
    """A first-order Markov chain over ``num_items`` items.

    From item ``i`` the next item is successor ``successors[i, j]`` with probability
    ``(1 - noise) * weights[j] + noise / num_items``, and any other item with
    ``noise / num_items``.

    Attributes:
        successors: ``(V, b)`` distinct successors of each item.
        weights: ``(b,)`` their probabilities, falling, summing to 1.
        noise: probability of a uniform jump.

    Example::

        >>> chain = MarkovChain.random(100, branching=4, noise=0.1, seed=0)
        >>> round(float(chain.probabilities(torch.tensor([3])).sum()), 12)
        1.0
    """

    successors: np.ndarray
    weights: np.ndarray
    noise: float

    @classmethod
    def random(cls, num_items: int, branching: int, noise: float, seed: int) -> "MarkovChain":
        """Successors drawn uniformly (distinct per item); weights proportional to 1, 1/2, ..., 1/b."""
        successors = _distinct_successors(num_items, num_items, branching, np.random.default_rng(seed))
        weights = 1.0 / np.arange(1, branching + 1)
        return cls(successors, weights / weights.sum(), float(noise))

    @classmethod
    def clustered(cls, num_items: int, branching: int, noise: float, clusters: int, seed: int) -> "MarkovChain":
        """Items in ``clusters`` hidden groups of about equal size (random ids, not ranges):
        every item of a group has the group's successors. The chain's rows then take at most
        ``clusters`` distinct values (a low-rank next-item matrix, as in catalogues whose
        items share categories), while each group's successors are still drawn uniformly.

        Example::

            >>> chain = MarkovChain.clustered(100, branching=4, noise=0.1, clusters=10, seed=0)
            >>> len(np.unique(chain.successors, axis=0))
            10
        """
        if not 1 <= clusters <= num_items:
            raise ValueError(f"MarkovChain.clustered: clusters={clusters} outside [1, num_items={num_items}]")
        # row g: group g's successors, drawn as the first `clusters` rows of random()'s
        group_successors = _distinct_successors(clusters, num_items, branching, np.random.default_rng(seed))
        group_of_item = np.random.default_rng(seed + 1).permutation(num_items) % clusters
        weights = 1.0 / np.arange(1, branching + 1)
        return cls(group_successors[group_of_item], weights / weights.sum(), float(noise))

    @property
    def num_items(self) -> int:
        return self.successors.shape[0]

    def probabilities(self, prev: torch.Tensor) -> torch.Tensor:
        """``(N, V)`` float64 next-item probabilities after items ``prev`` (the Bayes-optimal scores)."""
        prev = torch.as_tensor(prev, dtype=torch.int64)
        out = torch.full((len(prev), self.num_items), self.noise / self.num_items, dtype=torch.float64)
        succ = torch.from_numpy(self.successors)[prev]
        out.scatter_add_(1, succ, torch.from_numpy((1 - self.noise) * self.weights).expand(len(prev), -1).clone())
        return out

    def _sorted_probabilities(self, k: int) -> np.ndarray:
        """The ``k`` largest next-item probabilities, the same after every item (the
        successors' values first, then the uniform floor)."""
        floor = self.noise / self.num_items
        top = np.concatenate([(1 - self.noise) * self.weights + floor, np.full(max(0, k), floor)])
        return top[: min(k, self.num_items)]

    def best_hit_rate(self, k: int) -> float:
        """Best expected hit rate at ``k`` of any next-item ranking: the chance that the
        next item is among the ``k`` most probable. The same after every item, so also the
        optimum of any set of evaluation sequences."""
        return float(self._sorted_probabilities(k).sum())

    def best_ndcg(self, k: int) -> float:
        """Best expected NDCG at ``k`` (one relevant item): ``sum_j p_(j) / log2(j + 2)``
        over the ``k`` largest probabilities, which ranking by the chain attains."""
        p = self._sorted_probabilities(k)
        return float((p / np.log2(np.arange(len(p)) + 2)).sum())

    def sample(self, num_sessions: int, min_length: int, max_length: int, seed: int) -> Sequences:
        """Draw sessions: a uniform first item, then the chain; lengths uniform in ``[min_length, max_length]``."""
        rng = np.random.default_rng(seed)
        lengths = rng.integers(min_length, max_length + 1, num_sessions)
        steps = np.zeros((num_sessions, max_length), dtype=np.int64)
        steps[:, 0] = rng.integers(0, self.num_items, num_sessions)
        cdf = np.cumsum(self.weights)
        for t in range(1, max_length):  # all sessions advance together; short ones are cut below
            jump = rng.random(num_sessions) < self.noise
            pick = np.minimum(np.searchsorted(cdf, rng.random(num_sessions), side="right"), len(cdf) - 1)
            follow = self.successors[steps[:, t - 1], pick]
            steps[:, t] = np.where(jump, rng.integers(0, self.num_items, num_sessions), follow)
        mask = np.arange(max_length)[None, :] < lengths[:, None]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return Sequences(steps[mask], offsets)


def markov_sessions(
    num_sessions: int,
    num_items: int,
    *,
    min_length: int = 10,
    max_length: int = 30,
    branching: int = 4,
    noise: float = 0.1,
    clusters: int = 0,
    seed: int = 0,
) -> tuple[Sequences, MarkovChain]:
    """Synthetic sessions with a learnable signal and a known best next-item hit rate.

    Args:
        num_sessions: sessions (users).
        num_items: items of the chain.
        min_length, max_length: session lengths (uniform).
        branching: successors per item.
        noise: chance of a uniform jump.
        clusters: ``0``: every item's successors drawn on their own
            (:meth:`MarkovChain.random`); else items in this many hidden groups sharing their
            successors (:meth:`MarkovChain.clustered`).
        seed: seed of the chain and the sessions (the same seed gives the same data).

    Returns:
        ``(sessions, chain)``.

    Example::

        >>> seqs, chain = markov_sessions(100, 50, seed=1)
        >>> len(seqs), round(chain.best_hit_rate(1), 3)
        (100, 0.434)
    """
    chain = (
        MarkovChain.clustered(num_items, branching, noise, clusters, seed)
        if clusters
        else MarkovChain.random(num_items, branching, noise, seed)
    )
    return chain.sample(num_sessions, min_length, max_length, seed + 1), chain


# ----------------------------------------------------------------------------- interaction files

_SEPARATORS = {"csv": ",", "tsv": "\t", "dat": "::"}


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower().lstrip(".")
    if suffix in ("csv", "tsv", "dat", "parquet"):
        return suffix
    if suffix in ("pq", "txt", "data"):  # ml-100k's u.data is tab-separated
        return "parquet" if suffix == "pq" else "tsv"
    raise ValueError(f"{path}: cannot tell the format from the suffix {path.suffix!r}; set data.format")


@dataclass
class Interactions:
    """Per-user item sequences read from a file, sorted by time, item ids remapped.

    Attributes:
        sequences: one sequence per user (users in increasing raw id).
        user_ids: raw user id of each sequence.
        item_ids: raw item id of each remapped id ``0..V-1``.
        dropped_users: users left out for having too few interactions.
    """

    sequences: Sequences
    user_ids: np.ndarray
    item_ids: np.ndarray
    dropped_users: int = 0


def read_interactions(
    path: str | Path,
    *,
    fmt: str = "auto",
    separator: Optional[str] = None,
    header: bool = True,
    columns: Optional[Sequence[str]] = None,
    user_column: str = "userId",
    item_column: str = "movieId",
    time_column: str = "timestamp",
    min_sequence_length: int = 3,
    max_users: Optional[int] = None,
) -> Interactions:
    """Read a MovieLens-style interaction file into per-user sequences sorted by time.

    Items of one user with equal timestamps keep their order in the file. Item ids are
    remapped to ``0..V-1`` in increasing raw id, over the users kept.

    Args:
        path: a CSV / TSV / ``::``-separated text file or a Parquet file.
        fmt: ``"auto"`` (by suffix), ``"csv"``, ``"tsv"``, ``"dat"`` or ``"parquet"``.
        separator: field separator of a text file (``None``: by format).
        header: the text file's first line names the columns.
        columns: column names of a text file without a header.
        user_column, item_column, time_column: the columns used (others are ignored).
        min_sequence_length: users with fewer interactions are dropped.
        max_users: keep at most this many users (lowest raw ids).

    Raises:
        ValueError: a missing column, a line with too few or too many fields, or a value
            that is not an integer (time: a number), naming the file and the line (Parquet:
            the row); a file with no user left.

    Example::

        >>> data = read_interactions("ratings.csv")  # doctest: +SKIP
        >>> len(data.sequences), len(data.item_ids)  # doctest: +SKIP
        (610, 9724)
    """
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such interaction file")
    kind = _format_of(path, fmt)
    wanted = [user_column, item_column, time_column]
    first_line = 2 if header else 1  # file line of data row 0
    if kind == "parquet":
        frame = pd.read_parquet(path)
        where = "row"
        first_line = 0
    else:
        sep = separator if separator is not None else _SEPARATORS[kind]
        if not header and not columns:
            raise ValueError(f"{path}: a file without a header needs data.columns (the names of its columns)")
        try:
            frame = pd.read_csv(
                path,
                sep=sep,
                header=0 if header else None,
                names=None if header else list(columns or []),
                dtype=str,
                skip_blank_lines=False,  # keeps row i on file line i + first_line
                engine="python" if len(sep) > 1 else "c",
                keep_default_na=False,
                na_values=[""],
            )
        except pd.errors.ParserError as e:  # too many fields; pandas names the line
            raise ValueError(f"{path}: malformed line: {e}") from None
        where = "line"
        blank = frame.isna().all(axis=1).to_numpy()
        frame = frame[~blank]
    missing = [c for c in wanted if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: no column(s) {missing}; the file has {list(frame.columns)}")
    lines = frame.index.to_numpy() + first_line

    def numbers(column: str, integer: bool) -> np.ndarray:
        col = frame[column]
        if pd.api.types.is_datetime64_any_dtype(col):
            return col.astype("int64").to_numpy()
        values = pd.to_numeric(col, errors="coerce")
        bad = values.isna().to_numpy().copy()  # pandas may hand out a read-only view
        if integer and not bad.all():
            bad |= values.to_numpy(dtype=float, na_value=np.nan) % 1 != 0
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raw = col.iloc[i]
            problem = (
                "empty (too few fields?)"
                if raw is None or (isinstance(raw, float) and math.isnan(raw))
                else (f"{raw!r} is not {'an integer' if integer else 'a number'}")
            )
            raise ValueError(f"{path}, {where} {lines[i]}: column {column!r}: {problem}")
        return values.to_numpy(dtype=np.int64 if integer else np.float64)

    users, items, times = numbers(user_column, True), numbers(item_column, True), numbers(time_column, False)
    order = np.lexsort((np.arange(len(users)), times, users))  # by user, then time, then file order
    users, items = users[order], items[order]
    user_ids, starts, counts = np.unique(users, return_index=True, return_counts=True)
    keep = counts >= min_sequence_length
    dropped = int((~keep).sum())
    if max_users is not None:
        keep &= np.cumsum(keep) <= max_users
    if not keep.any():
        raise ValueError(f"{path}: no user has {min_sequence_length} or more interactions ({len(user_ids)} users read)")
    rows = np.repeat(keep, counts)
    items = items[rows]
    item_ids, remapped = np.unique(items, return_inverse=True)
    offsets = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
    return Interactions(Sequences(remapped.astype(np.int64), offsets), user_ids[keep], item_ids, dropped)
