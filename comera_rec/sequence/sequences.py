"""Jagged item sequences and the batches of the masked-item model.

:class:`Sequences` holds per-user item sequences (with an optional target each);
:func:`training_batches` yields the masked (cloze) training batches of an epoch and
:func:`evaluation_batches` the batches that predict each sequence's target;
:func:`leave_one_out` splits sequences into train, validation and test
(:class:`SequenceSplits`). The generator and the file reader are in :mod:`.data`.
"""

from __future__ import annotations

from dataclasses import dataclass
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
