"""Data positions as row intervals: a reader stopped after some batches and resumed, with the
same or another number of processes, reads every row of the epoch exactly once."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comera_rec.data import (
    CriteoNpyReader,
    CriteoParquetReader,
    CriteoReaderConfig,
    CriteoTsvReader,
    SyntheticCriteo,
    SyntheticCriteoConfig,
    split_row_range,
)
from comera_rec.data.position import ReadPosition, num_rows, remaining_after, resplit, resume_position
from comera_rec.data.preprocess import preprocess_tsv_to_parquet

READERS = {"tsv": CriteoTsvReader, "parquet": CriteoParquetReader, "npy": CriteoNpyReader}
BAD_EVERY = 13  # TSV: every 13th line is malformed (one field short) and skipped


# ------------------------------------------------------------------ the interval algebra
@st.composite
def parts_of_rows(draw):
    """Disjoint intervals over [0, 200), dealt to 1-4 old processes in some order."""
    cuts = sorted(draw(st.sets(st.integers(0, 200), min_size=2, max_size=12)))
    intervals = [(a, b) for a, b in zip(cuts, cuts[1:])]
    intervals = draw(st.permutations(intervals))
    owners = draw(st.lists(st.integers(0, 3), min_size=len(intervals), max_size=len(intervals)))
    return [[iv for iv, o in zip(intervals, owners) if o == r] for r in range(max(owners, default=0) + 1)]


@settings(max_examples=200, deadline=None, database=None)
@given(parts=parts_of_rows(), new_world=st.integers(1, 6))
def test_resplit_keeps_every_row_once_in_order(parts, new_world):
    new = resplit(parts, new_world)
    assert len(new) == new_world
    flat_old = [r for p in parts for lo, hi in p for r in range(lo, hi)]
    flat_new = [r for p in new for lo, hi in p for r in range(lo, hi)]
    if new_world == len(parts):
        assert new == parts  # the same processes keep their own rows
    else:
        assert flat_new == flat_old  # rank order, reading order, each row once
        sizes = [num_rows(p) for p in new]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=200, deadline=None, database=None)
@given(parts=parts_of_rows(), data=st.data())
def test_remaining_after_drops_exactly_the_rows_read(parts, data):
    plan = parts[0]
    rows = [r for lo, hi in plan for r in range(lo, hi)]
    k = data.draw(st.integers(0, len(rows)))
    left = remaining_after(plan, rows[k - 1] if k else None)
    assert [r for lo, hi in left for r in range(lo, hi)] == rows[k:]


def test_remaining_after_refuses_a_row_outside_the_plan():
    with pytest.raises(ValueError, match="row 7 is not in the reader's plan"):
        remaining_after([(0, 5)], 7)


def test_position_round_trips_as_plain_data():
    pos = ReadPosition([(3, 9), (20, 21)], batches_left=2, layout={"block_rows": 64})
    state = pos.to_state()
    assert state == {"remaining": [[3, 9], [20, 21]], "batches_left": 2, "layout": {"block_rows": 64}}
    assert ReadPosition.from_state(state) == pos
    with pytest.raises(ValueError, match=r"bad row interval \[9, 3\)"):
        ReadPosition.from_state({"remaining": [[9, 3]]})


def test_drop_last_cap_after_a_resize_is_the_smallest_part():
    states = [ReadPosition([(0, 10)], 1).to_state(), ReadPosition([(25, 40)], 1).to_state()]
    # 25 rows left over 3 processes: parts of 8, 8, 9 rows -> 2 full batches of 4 each
    assert [resume_position(states, r, 3, 4).batches_left for r in range(3)] == [2, 2, 2]
    assert resume_position(states, 1, 2, 4) == ReadPosition([(25, 40)], 1)  # same world: as saved


# ------------------------------------------------------------------ the file readers
@pytest.fixture(scope="module")
def indexed_files(tmp_path_factory):
    """Three files (120, 0 and 190 rows); a row's cat_0 is its global line number. In the
    TSV every BAD_EVERY-th line is malformed; the Parquet and npy files hold the good rows."""
    d = tmp_path_factory.mktemp("positions")
    sizes = [120, 0, 190]
    tsv, npy, start = [], [], 0
    for i, n in enumerate(sizes):
        lines = []
        for r in range(start, start + n):
            fields = [str(r % 2), str(r)] + [""] * 12 + [f"{r:x}"] * 26
            lines.append("\t".join(fields[:-1] if r % BAD_EVERY == 5 else fields))
        (d / f"day_{i}").write_text("".join(line + "\n" for line in lines))
        tsv.append(str(d / f"day_{i}"))
        good = np.array([r for r in range(start, start + n)], np.int64)
        np.save(d / f"day_{i}_dense.npy", np.zeros((n, 13), np.float32))
        np.save(d / f"day_{i}_sparse.npy", np.repeat(good[:, None], 26, 1).reshape(n, 26))
        np.save(d / f"day_{i}_labels.npy", (good % 2).astype(np.int32).reshape(n, 1))
        npy.append(str(d / f"day_{i}_dense.npy"))
        start += n
    logging.getLogger("comera_rec").setLevel(logging.ERROR)  # the empty file and the bad lines warn
    preprocess_tsv_to_parquet(tsv, str(d / "pq"), progress=False, row_group_rows=50)
    return {"tsv": tsv, "npy": npy, "parquet": [str(d / "pq" / f"day_{i}.parquet") for i in range(3)], "sizes": sizes}


def _reader(files, kind, rank, world, batch_size, chunk, drop_last=False):
    cfg = CriteoReaderConfig(
        paths=files[kind],
        batch_size=batch_size,
        rank=rank,
        world_size=world,
        split="train",
        holdout="kaggle",
        drop_last=drop_last,
        chunk_bytes=chunk,
        chunk_rows=max(chunk // 40, 1),
    )
    return READERS[kind](cfg)


def _ids(batch) -> np.ndarray:
    return batch.sparse_features.values().numpy().reshape(26, -1)[0]  # cat_0 of each row


def _expected_rows(files, kind) -> np.ndarray:
    """cat_0 of the train split's rows: the TSV's lines minus the bad ones; Parquet holds only
    the good lines (preprocessing dropped the bad ones), npy every line."""
    rows = np.arange(sum(files["sizes"]))
    good = rows[rows % BAD_EVERY != 5]
    if kind == "parquet":
        sizes = [
            int(((good >= a) & (good < a + n)).sum()) for a, n in zip(np.cumsum([0] + files["sizes"]), files["sizes"])
        ]
        start, stop = split_row_range(len(good), sizes, "train", "kaggle")
        return good[start:stop]
    start, stop = split_row_range(len(rows), files["sizes"], "train", "kaggle")
    rows = rows[start:stop]
    return rows[rows % BAD_EVERY != 5] if kind == "tsv" else rows


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["tsv", "parquet", "npy"]),
    old_world=st.integers(1, 4),
    new_world=st.integers(1, 4),
    batch_size=st.integers(1, 40),
    steps=st.integers(0, 12),
    chunk=st.integers(200, 4000),
)
def test_interrupted_and_resized_epoch_reads_every_row_once(
    indexed_files, kind, old_world, new_world, batch_size, steps, chunk
):
    seen, states = [], []
    for rank in range(old_world):  # the interrupted run: `steps` batches on every process
        reader = _reader(indexed_files, kind, rank, old_world, batch_size, chunk)
        batches = iter(reader)
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                break
            seen.append(_ids(batch))
        states.append(reader.position().to_state())
    for rank in range(new_world):  # the resumed run, with another number of processes
        reader = _reader(indexed_files, kind, rank, new_world, batch_size, chunk)
        reader.resume(resume_position(states, rank, new_world, batch_size))
        seen += [_ids(b) for b in reader]
    got = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    np.testing.assert_array_equal(np.sort(got), _expected_rows(indexed_files, kind))


@pytest.mark.parametrize("kind", ["tsv", "parquet"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_world_resume_continues_each_process_exactly(indexed_files, kind, drop_last):
    for rank in range(2):
        whole = [_ids(b) for b in _reader(indexed_files, kind, rank, 2, 7, 300, drop_last)]
        reader = _reader(indexed_files, kind, rank, 2, 7, 300, drop_last)
        batches = iter(reader)
        first = [_ids(next(batches)) for _ in range(4)]
        state = reader.position().to_state()
        resumed = _reader(indexed_files, kind, rank, 2, 7, 300, drop_last)
        resumed.resume(resume_position([state, state], rank, 2, 7))
        rest = [_ids(b) for b in resumed]
        assert len(first) + len(rest) == len(whole)
        for got, want in zip(first + rest, whole):
            np.testing.assert_array_equal(got, want)


def test_resume_reads_only_the_rows_left(indexed_files):
    # a resumed pass parses the rows after the position, not the ones before it
    reader = _reader(indexed_files, "tsv", 0, 1, 10, 500)
    batches = iter(reader)
    for _ in range(20):
        next(batches)
    state = reader.position().to_state()
    resumed = _reader(indexed_files, "tsv", 0, 1, 10, 500)
    resumed.resume(resume_position([state], 0, 1, 10))
    rest = sum(len(_ids(b)) for b in resumed)
    assert resumed.stats.rows == rest == len(_expected_rows(indexed_files, "tsv")) - 200


def test_a_position_past_the_files_is_a_named_error(indexed_files):
    reader = _reader(indexed_files, "npy", 0, 1, 10, 500)
    reader.resume(ReadPosition([(300, 400)]))
    with pytest.raises(ValueError, match=r"rows \[300, 400\) are past the end of the input \(310 rows\)"):
        next(iter(reader))


# ------------------------------------------------------------------ the synthetic stream
def _synthetic(rank, world, batch_size=16, drop_last=False):
    cfg = SyntheticCriteoConfig(
        num_embeddings_per_feature=[50] * 26,
        batch_size=batch_size,
        num_rows=500,
        block_rows=64,
        rank=rank,
        world_size=world,
        drop_last=drop_last,
        seed=3,
    )
    gen = SyntheticCriteo(cfg)
    gen.set_epoch(2)
    return gen


def _rows(batch) -> list[tuple]:
    ids = batch.sparse_features.values().numpy().reshape(26, -1).T
    dense = batch.dense_features.numpy()
    return [tuple(d.tolist()) + tuple(i.tolist()) for d, i in zip(dense, ids)]


@settings(max_examples=25, deadline=None, database=None)
@given(old_world=st.integers(1, 3), new_world=st.integers(1, 3), steps=st.integers(0, 12))
def test_synthetic_epoch_resized_mid_way_generates_every_row_once(old_world, new_world, steps):
    whole = Counter(r for b in _synthetic(0, 1) for r in _rows(b))
    seen, states = Counter(), []
    for rank in range(old_world):
        gen = _synthetic(rank, old_world)
        batches = iter(gen)
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                break
            seen.update(_rows(batch))
        states.append(gen.position().to_state())
    for rank in range(new_world):
        gen = _synthetic(rank, new_world)
        gen.resume(resume_position(states, rank, new_world, 16))
        for b in gen:
            seen.update(_rows(b))
    assert seen == whole


def test_synthetic_same_world_resume_is_the_uninterrupted_stream():
    whole = [_rows(b) for b in _synthetic(1, 2, drop_last=True)]
    gen = _synthetic(1, 2, drop_last=True)
    batches = iter(gen)
    first = [_rows(next(batches)) for _ in range(5)]
    state = gen.position().to_state()
    resumed = _synthetic(1, 2, drop_last=True)
    resumed.resume(resume_position([state, state], 1, 2, 16))
    assert first + [_rows(b) for b in resumed] == whole


def test_endless_synthetic_stream_has_no_position():
    gen = SyntheticCriteo(SyntheticCriteoConfig(num_embeddings_per_feature=[50] * 26, batch_size=8, num_rows=None))
    next(iter(gen))
    assert gen.position() is None
