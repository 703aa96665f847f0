"""A reader's place in an epoch as global row intervals, and the re-split of what is left.

A reader walks its part of the epoch's rows in order. Its position after a batch is the
list of row intervals it has still to read (:class:`ReadPosition`); a checkpoint stores
every process's. On resume, each process hands its own list back to its reader (same
number of processes: the run goes on as if never stopped), or, with another number of
processes, the lists are joined in rank order and cut into equal contiguous parts
(:func:`resplit`), so every row left in the epoch is read once, by one process.

Rows are numbered over the whole input: for files, the physical rows of the files
concatenated (TSV lines, bad ones included, which are skipped again when re-read); for the
synthetic stream, ``block * block_rows + offset``.

Example::

    >>> parts = [[(0, 10)], [(10, 20)]]                  # two processes, ten rows each
    >>> left = [remaining_after(parts[0], 3), remaining_after(parts[1], 13)]
    >>> left
    [[(4, 10)], [(14, 20)]]
    >>> resplit(left, 3)                                 # resumed with three processes
    [[(4, 8)], [(8, 10), (14, 16)], [(16, 20)]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

Interval = tuple[int, int]  # global rows [lo, hi)


@dataclass
class ReadPosition:
    """What one process has left to read of the epoch.

    Example::

        >>> ReadPosition([(4, 10)], batches_left=1).to_state()
        {'remaining': [[4, 10]], 'batches_left': 1, 'layout': {}}
    """

    remaining: list[Interval]
    """Global row intervals still to read, in reading order."""
    batches_left: Optional[int] = None
    """drop_last: full batches the process may still yield (the same on every process); None: no cap."""
    layout: dict[str, int] = field(default_factory=dict)
    """Reader facts the row numbers depend on (the synthetic stream's ``block_rows``)."""

    def to_state(self) -> dict[str, Any]:
        """A plain dict of ints and lists (checkpoints load it without unpickling objects)."""
        return {
            "remaining": [[int(lo), int(hi)] for lo, hi in self.remaining],
            "batches_left": self.batches_left,
            "layout": {str(k): int(v) for k, v in self.layout.items()},
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ReadPosition":
        """Inverse of :meth:`to_state`; checks the intervals.

        Raises:
            ValueError: an interval that is empty-reversed or negative.
        """
        remaining = [(int(lo), int(hi)) for lo, hi in state["remaining"]]
        for lo, hi in remaining:
            if not 0 <= lo <= hi:
                raise ValueError(f"data position: bad row interval [{lo}, {hi})")
        left = state.get("batches_left")
        return cls(remaining, None if left is None else int(left), dict(state.get("layout", {})))


def num_rows(intervals: Sequence[Interval]) -> int:
    """Rows in ``intervals``.

    Example::

        >>> num_rows([(0, 3), (5, 6)])
        4
    """
    return sum(hi - lo for lo, hi in intervals)


def remaining_after(plan: Sequence[Interval], last_row: Optional[int]) -> list[Interval]:
    """The intervals of ``plan`` (read in order) left once row ``last_row`` has been read.

    Args:
        plan: the rows a process reads, in order; intervals do not overlap.
        last_row: the last row read (None: nothing read yet).

    Raises:
        ValueError: ``last_row`` is in no interval of the plan.

    Example::

        >>> remaining_after([(10, 20), (0, 5)], 19)
        [(0, 5)]
    """
    if last_row is None:
        return [(lo, hi) for lo, hi in plan if hi > lo]
    for i, (lo, hi) in enumerate(plan):
        if lo <= last_row < hi:
            rest = [(last_row + 1, hi)] if last_row + 1 < hi else []
            return rest + [(a, b) for a, b in plan[i + 1 :] if b > a]
    raise ValueError(f"data position: row {last_row} is not in the reader's plan {list(plan)[:4]}...")


def take_rows(intervals: Sequence[Interval], start: int, stop: int) -> list[Interval]:
    """Rows ``start .. stop-1`` of the sequence the intervals spell out, as intervals.

    Example::

        >>> take_rows([(0, 4), (10, 14)], 2, 6)
        [(2, 4), (10, 12)]
    """
    out: list[Interval] = []
    seen = 0
    for lo, hi in intervals:
        n = hi - lo
        a, b = max(start - seen, 0), min(stop - seen, n)
        if a < b:
            out.append((lo + a, lo + b))
        seen += n
        if seen >= stop:
            break
    return out


def resplit(parts: Sequence[Sequence[Interval]], num_parts: int) -> list[list[Interval]]:
    """Cut the rows left by every process into ``num_parts`` contiguous parts.

    With as many parts as before, each process keeps its own rows (an uninterrupted run's
    order); otherwise the rows are joined in rank order and cut into parts whose sizes
    differ by one row at most. Every row is in exactly one part either way.

    Args:
        parts: each old process's remaining intervals, by rank.
        num_parts: the new number of processes.

    Example::

        >>> resplit([[(0, 2)], [(5, 9)]], 1)
        [[(0, 2), (5, 9)]]
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if len(parts) == num_parts:
        return [list(p) for p in parts]
    joined = [iv for p in parts for iv in p if iv[1] > iv[0]]
    total = num_rows(joined)
    return [take_rows(joined, r * total // num_parts, (r + 1) * total // num_parts) for r in range(num_parts)]


def resume_position(states: Sequence[dict[str, Any]], rank: int, world_size: int, batch_size: int) -> ReadPosition:
    """This process's position when a run resumes from the saved ``states`` (one per old rank).

    Args:
        states: :meth:`ReadPosition.to_state` of every process of the run that saved them.
        rank: this process's rank in the resumed run.
        world_size: processes in the resumed run.
        batch_size: rows per batch (for the drop_last cap after a re-split).

    Raises:
        ValueError: the saved positions disagree on the reader layout.
    """
    saved = [ReadPosition.from_state(s) for s in states]
    layouts = {tuple(sorted(p.layout.items())) for p in saved}
    if len(layouts) > 1:
        raise ValueError(f"data position: the saved processes disagree on the reader layout: {sorted(layouts)}")
    parts = resplit([p.remaining for p in saved], world_size)
    if len(saved) == world_size:
        left = saved[rank].batches_left
    elif saved[0].batches_left is None:
        left = None
    else:  # drop_last: every process yields as many full batches as the smallest part allows
        left = min(num_rows(p) for p in parts) // batch_size
    return ReadPosition(parts[rank], left, dict(saved[0].layout))


@dataclass
class PassCursor:
    """A reader's progress through one pass: the plan it reads and the last row it yielded.

    Args:
        plan: the pass's global row intervals in reading order, or a function giving them
            (computed only when a position is asked for).
        max_batches: drop_last's cap on the batches of the pass (None: no cap).
        layout: see :attr:`ReadPosition.layout`.

    Example::

        >>> cursor = PassCursor([(0, 8)], max_batches=None)
        >>> cursor.yielded(3)             # a batch whose last row was row 3
        >>> cursor.position().remaining
        [(4, 8)]
    """

    plan: Any
    max_batches: Optional[int]
    layout: dict[str, int] = field(default_factory=dict)
    to_row: Optional[Callable[[int], int]] = None
    """Turns what :meth:`yielded` got into a global row number (a reader's cheaper key); None: it is one."""
    emitted: int = 0
    last_row: Optional[int] = None

    def yielded(self, last_row: int) -> None:
        """Count a batch whose last row (in reading order) is ``last_row`` (or its key)."""
        self.emitted += 1
        self.last_row = int(last_row)

    def position(self) -> ReadPosition:
        """What is left of the pass after the batches yielded so far."""
        plan = self.plan() if callable(self.plan) else self.plan
        last = self.last_row
        if last is not None and self.to_row is not None:
            last = self.to_row(last)
        left = None if self.max_batches is None else max(self.max_batches - self.emitted, 0)
        return ReadPosition(remaining_after(plan, last), left, dict(self.layout))
