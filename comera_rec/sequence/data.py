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
* :class:`Sequences` holds jagged sequences and yields the model's batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

# ----------------------------------------------------------------------------- jagged sequences


@dataclass
class Sequences:
    """Jagged item sequences (one per user), with an optional target item each.

    Attributes:
        values: ``(N,)`` int64 item ids, the sequences one after another.
        offsets: ``(S + 1,)`` int64 start of each sequence in ``values``.
        targets: ``(S,)`` int64 item to predict after each sequence, or ``None`` (training).

    Example::

        >>> s = Sequences.from_lists([[1, 2, 3], [4]], targets=[5, 6])
        >>> len(s), s[0].tolist(), s.lengths().tolist()
        (2, [1, 2, 3], [3, 1])
    """

    values: np.ndarray
    offsets: np.ndarray
    targets: Optional[np.ndarray] = None

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]], targets: Optional[Sequence[int]] = None) -> "Sequences":
        """Build from Python lists (or arrays) of item ids."""
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]) if len(seqs) else np.zeros(0, np.int64)
        return cls(values, offsets, None if targets is None else np.asarray(targets, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def batch(self, rows: np.ndarray, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, lengths)`` of sequences ``rows``, each cut to its last ``max_len`` items."""
        ends = self.offsets[rows + 1]
        starts = np.maximum(self.offsets[rows], ends - max_len)
        lengths = ends - starts
        # one gather for the whole batch: position j of row r is starts[r] + j
        first = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        index = first + np.arange(int(lengths.sum()))
        return torch.from_numpy(self.values[index]), torch.from_numpy(lengths)


def training_batches(
    seqs: Sequences,
    batch_size: int,
    max_len: int,
    mask_id: int,
    *,
    mask_prob: float,
    mask_last_prob: float,
    seed: int,
    shard: tuple[int, int] = (0, 1),
) -> Iterator[dict[str, torch.Tensor]]:
    """Masked (cloze) batches of one epoch, the same for the same ``seed``.

    Each item is masked with ``mask_prob``, the last one also with ``mask_last_prob``
    (the position evaluation predicts), and at least one per sequence: masked items are
    replaced by ``mask_id`` and become the labels.

    Args:
        seqs: the training sequences.
        batch_size: sequences per batch (the last, short batch is dropped).
        max_len: keep each sequence's last ``max_len`` items.
        mask_id: the id of the mask token (the row after the last item).
        mask_prob, mask_last_prob: see above.
        seed: shuffling and masking seed (one per epoch).
        shard: ``(rank, world)``: this process takes every world-th batch row.

    Yields:
        ``{"values", "lengths", "picked", "labels"}``: the masked ids and lengths (jagged),
        ``picked`` a bool per value (masked), ``labels`` the true ids of the picked values.

    Example::

        >>> s = Sequences.from_lists([[1, 2, 3], [4, 5]] * 4)
        >>> b = next(training_batches(s, 2, 50, 9, mask_prob=0.2, mask_last_prob=0.5, seed=0))
        >>> b["values"].shape == b["picked"].shape, bool((b["values"][b["picked"]] == 9).all())
        (True, True)
    """
    rng = np.random.default_rng(seed)
    rank, world = shard
    order = rng.permutation(len(seqs))
    order = order[: len(order) - len(order) % world][rank::world]
    for start in range(0, len(order) - batch_size + 1, batch_size):
        values, lengths = seqs.batch(order[start : start + batch_size], max_len)
        n, row_lengths = values.numel(), lengths.numpy()
        picked = rng.random(n) < mask_prob
        last = np.cumsum(row_lengths) - 1
        picked[last] |= rng.random(len(last)) < mask_last_prob
        # a row with nothing masked gets one random position, so every row is trained on
        first = last - row_lengths + 1
        counts = np.add.reduceat(picked, first) if n else np.zeros(0)
        for row in np.flatnonzero(counts == 0):
            picked[first[row] + rng.integers(row_lengths[row])] = True
        picked_t = torch.from_numpy(picked)
        labels = values[picked_t].clone()
        values = values.clone()
        values[picked_t] = mask_id
        yield {"values": values, "lengths": lengths, "picked": picked_t, "labels": labels}


def evaluation_batches(
    seqs: Sequences, batch_size: int, max_len: int, mask_id: int, shard: tuple[int, int] = (0, 1)
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches that predict each sequence's target from its history and a mask at the end.

    The history is cut to its last ``max_len - 1`` items, then ``mask_id`` appended; the
    picked value is that mask, the label the target.
    """
    if seqs.targets is None:
        raise ValueError("evaluation_batches: the sequences have no targets")
    rank, world = shard
    rows = np.arange(len(seqs))[rank::world]
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        history, lengths = seqs.batch(chunk, max_len - 1)
        ends = torch.cumsum(lengths, 0) + torch.arange(1, len(chunk) + 1)  # after each row's mask
        values = torch.full((history.numel() + len(chunk),), mask_id, dtype=torch.int64)
        keep = torch.ones_like(values, dtype=torch.bool)
        keep[ends - 1] = False
        values[keep] = history
        yield {
            "values": values,
            "lengths": lengths + 1,
            "picked": ~keep,
            "labels": torch.from_numpy(seqs.targets[chunk]),
        }


@dataclass
class SequenceSplits:
    """The leave-one-out split of a set of user sequences.

    Attributes:
        train: each user's items but the last two (no targets).
        val: the same histories with the second-to-last item as the target.
        test: the histories plus the validation item, with the last item as the target.
        num_items: items (ids are ``0..num_items-1``; the mask token is ``num_items``).
        item_ids: raw id of each item (files), or ``None`` (synthetic).
    """

    train: Sequences
    val: Sequences
    test: Sequences
    num_items: int
    item_ids: Optional[np.ndarray] = None


def leave_one_out(seqs: Sequences, num_items: int, item_ids: Optional[np.ndarray] = None) -> SequenceSplits:
    """Split every sequence (of at least 3 items): train on all but the last two, validate
    on the second-to-last, test on the last.

    Example::

        >>> sp = leave_one_out(Sequences.from_lists([[0, 1, 2, 3]]), num_items=4)
        >>> sp.train[0].tolist(), sp.val.targets.tolist(), sp.test[0].tolist(), sp.test.targets.tolist()
        ([0, 1], [2], [0, 1, 2], [3])
    """
    lengths = seqs.lengths()
    if len(lengths) and int(lengths.min()) < 3:
        raise ValueError(f"leave_one_out: every sequence needs 3 items, the shortest has {int(lengths.min())}")
    starts, ends = seqs.offsets[:-1], seqs.offsets[1:]

    def cut(drop: int) -> Sequences:
        keep = np.repeat(np.arange(len(seqs)), lengths - drop)
        pos = np.arange(len(keep)) - np.repeat(np.concatenate([[0], np.cumsum(lengths - drop)[:-1]]), lengths - drop)
        values = seqs.values[starts[keep] + pos]
        offsets = np.concatenate([[0], np.cumsum(lengths - drop)]).astype(np.int64)
        return Sequences(values, offsets)

    train, test = cut(2), cut(1)
    val = Sequences(train.values, train.offsets, seqs.values[ends - 2])
    test.targets = seqs.values[ends - 1]
    return SequenceSplits(train, val, test, num_items, item_ids)


# ----------------------------------------------------------------------------- synthetic sessions


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
        rng = np.random.default_rng(seed)
        successors = (
            np.argsort(rng.random((num_items, num_items)), axis=1)[:, :branching]
            if num_items <= 4096
            else (np.stack([rng.choice(num_items, branching, replace=False) for _ in range(num_items)]))
        )
        weights = 1.0 / np.arange(1, branching + 1)
        return cls(successors.astype(np.int64), weights / weights.sum(), float(noise))

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
    seed: int = 0,
) -> tuple[Sequences, MarkovChain]:
    """Synthetic sessions with a learnable signal and a known best next-item hit rate.

    Args:
        num_sessions: sessions (users).
        num_items: items of the chain.
        min_length, max_length: session lengths (uniform).
        branching: successors per item.
        noise: chance of a uniform jump.
        seed: seed of the chain and the sessions (the same seed gives the same data).

    Returns:
        ``(sessions, chain)``.

    Example::

        >>> seqs, chain = markov_sessions(100, 50, seed=1)
        >>> len(seqs), round(chain.best_hit_rate(1), 3)
        (100, 0.434)
    """
    chain = MarkovChain.random(num_items, branching, noise, seed)
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
