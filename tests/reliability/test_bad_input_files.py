"""Damaged and wrong-format input files, read directly by the readers: every error names the
file (and line or column), and ``bad_input="skip"`` drops and counts what it can."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from comera_rec.data.criteo import CAT_NAMES, INT_NAMES, LABEL_NAME
from comera_rec.data.readers import (
    BadInputError,
    CriteoNpyReader,
    CriteoParquetReader,
    CriteoReaderConfig,
    CriteoTsvReader,
    count_lines,
)


def line(i: int, rng: np.random.Generator) -> str:
    """A good labelled Criteo line whose int_0 is ``i`` (random categories: gzip cannot squeeze them)."""
    cats = [f"{v:08x}" for v in rng.integers(0, 2**32, 26)]
    return "\t".join(["1", str(i)] + [str(j) for j in range(12)] + cats)


def lines(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [line(i, rng) for i in range(n)]


def read(path: Path, **cfg) -> tuple[CriteoTsvReader, np.ndarray]:
    """All rows of one TSV reader as the int_0 column (the row index of lines())."""
    reader = CriteoTsvReader(CriteoReaderConfig(paths=[str(path)], batch_size=16, has_label=True, **cfg))
    return reader, int0(reader)


def int0(reader) -> np.ndarray:
    got = [np.rint(np.expm1(b.dense_features[:, 0].numpy())).astype(np.int64) for b in reader]
    return np.concatenate(got) if got else np.zeros(0, np.int64)


# -- a truncated gzip file ------------------------------------------------------------------


@pytest.fixture
def truncated_gz(tmp_path: Path) -> tuple[Path, int]:
    """day_0.gz of 400 lines cut in the middle of its compressed stream; (path, whole lines left)."""
    data = gzip.compress(("\n".join(lines(400)) + "\n").encode())
    path = tmp_path / "day_0.gz"
    path.write_bytes(data[: len(data) // 2])
    with gzip.open(path, "rb") as f:
        got = b""
        try:
            while part := f.read1(1 << 12):
                got += part
        except EOFError:
            pass
    whole = got.count(b"\n")
    assert 50 < whole < 350
    return path, whole


def test_truncated_gzip_keeps_the_rows_before_the_damage_under_skip(truncated_gz, caplog) -> None:
    path, whole = truncated_gz
    with caplog.at_level(logging.WARNING, logger="comera_rec"):
        reader, got = read(path, chunk_bytes=4096)
    np.testing.assert_array_equal(got, np.arange(whole))  # every whole line before the damage, the broken one dropped
    assert reader.stats.damaged_files == 1 and reader.stats.bad_lines == 0
    assert f"{path}: damaged gzip stream after line {whole}" in caplog.text
    # sharded: the lines are counted first, up to the damage; the two ranks share those lines
    parts = [read(path, world_size=2, rank=r)[1] for r in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), np.arange(whole))


def test_truncated_gzip_under_strict_yields_the_rows_then_names_file_and_line(truncated_gz) -> None:
    path, whole = truncated_gz
    reader = CriteoTsvReader(
        CriteoReaderConfig(paths=[str(path)], batch_size=16, has_label=True, bad_input="strict", chunk_bytes=4096)
    )
    it = iter(reader)
    rows = 0
    with pytest.raises(
        BadInputError,
        match=rf"{path.name}: damaged gzip stream after line {whole} near compressed "
        r"byte \d+ of \d+: EOFError",
    ):
        for b in it:
            rows += len(b.labels)
    assert rows == whole // 16 * 16  # the full batches before the damage were yielded
    with pytest.raises(BadInputError, match=rf"{path.name}: damaged gzip stream after line {whole}"):
        count_lines(path)
    with pytest.raises(BadInputError, match=rf"{path.name}: damaged gzip stream"):  # counted first when sharded
        list(CriteoTsvReader(CriteoReaderConfig(paths=[str(path)], has_label=True, bad_input="strict", world_size=2)))


# -- an invalid UTF-8 byte, a stray carriage return ----------------------------------------------


@pytest.mark.parametrize("where,field", [(20, "field 21 \\(cat_6\\)"), (3, "field 4 \\(int_2\\)")])
def test_invalid_utf8_byte_names_file_line_and_field(tmp_path: Path, where: int, field: str) -> None:
    rows = [s.encode() for s in lines(5)]
    f = rows[2].split(b"\t")
    f[where] = f[where][:1] + b"\xff" + f[where][1:]
    rows[2] = b"\t".join(f)
    path = tmp_path / "utf8.tsv"
    path.write_bytes(b"\n".join(rows) + b"\n")
    reader, got = read(path)
    np.testing.assert_array_equal(got, [0, 1, 3, 4])
    assert reader.stats.bad_lines == 1 and reader.stats.bad_by_reason == {"utf8": 1}
    with pytest.raises(BadInputError, match=rf"utf8.tsv:3: invalid UTF-8 byte 0xff in {field}"):
        read(path, bad_input="strict")


@pytest.mark.parametrize("offset", [30, 0, -3])  # inside the line, at its start, in its last field
def test_carriage_return_inside_a_line_names_file_and_line(tmp_path: Path, offset: int) -> None:
    rows = [s.encode() for s in lines(6)]
    pos = offset % len(rows[1])
    rows[1] = rows[1][:pos] + b"\r" + rows[1][pos:]
    rows[4] = rows[4][:50] + b"\r" + rows[4][50:]
    path = tmp_path / "cr.tsv"
    path.write_bytes(b"\n".join(rows) + b"\n")
    reader, got = read(path)
    np.testing.assert_array_equal(got, [0, 2, 3, 5])  # the other rows intact: no shifted columns
    assert reader.stats.bad_by_reason == {"cr": 2}
    with pytest.raises(BadInputError, match=r"cr.tsv:2: a carriage return \(\\r\) inside the line, in field \d+"):
        read(path, bad_input="strict")


def test_windows_line_ends_still_read(tmp_path: Path) -> None:
    path = tmp_path / "crlf.tsv"
    path.write_bytes(("\r\n".join(lines(7)) + "\r\n").encode())
    reader, got = read(path, bad_input="strict")
    np.testing.assert_array_equal(got, np.arange(7))
    rows = [s.encode() for s in lines(7)]
    rows[3] = rows[3][:40] + b"\r" + rows[3][40:]
    path.write_bytes(b"\r\n".join(rows) + b"\r\n")
    with pytest.raises(BadInputError, match=r"crlf.tsv:4: a carriage return"):
        read(path, bad_input="strict")


# -- Parquet of the wrong column types --------------------------------------------------------


def test_parquet_string_categories_name_file_column_and_types(tmp_path: Path) -> None:
    n = 4
    cols = {LABEL_NAME: pa.array(np.ones(n, np.int8))}
    cols.update({c: pa.array(np.arange(n, dtype=np.int64)) for c in INT_NAMES})
    cols.update({c: pa.array(np.arange(n, dtype=np.int64)) for c in CAT_NAMES})
    cols["cat_3"] = pa.array(["68fd1e64"] * n)  # raw hex strings, not the preprocessed integer ids
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(cols), path)
    for mode in ("skip", "strict"):
        for world_size in (1, 2):  # read directly, and counted first
            cfg = CriteoReaderConfig(paths=[str(path)], bad_input=mode, world_size=world_size)
            with pytest.raises(BadInputError, match=r"train.parquet: column 'cat_3' has type string, expected int64"):
                list(CriteoParquetReader(cfg))


def test_parquet_damaged_row_group_names_file_and_group(tmp_path: Path) -> None:
    """Corrupt data pages in row group 0 of 2: strict names the file and the group; skip
    reads the other group and counts the damaged one."""
    n = 64
    rng = np.random.default_rng(0)
    cols = {LABEL_NAME: pa.array(rng.integers(0, 2, n).astype(np.int8))}
    cols.update({c: pa.array(rng.integers(0, 1 << 20, n)) for c in INT_NAMES + CAT_NAMES})
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(cols), path, row_group_size=n // 2, compression="snappy")
    meta = pq.ParquetFile(path).metadata
    data = bytearray(path.read_bytes())
    for j in range(meta.num_columns):  # garbage over every column chunk of row group 0
        chunk = meta.row_group(0).column(j)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match=r"train.parquet: row group 0 \(rows 0..31\) cannot be decoded"):
        list(CriteoParquetReader(CriteoReaderConfig(paths=[str(path)], bad_input="strict")))
    reader = CriteoParquetReader(CriteoReaderConfig(paths=[str(path)], bad_input="skip", batch_size=8))
    rows = sum(int(b.labels.shape[0]) for b in reader)
    assert rows == n // 2 and reader.stats.damaged_row_groups == 1


# -- npy: pickled objects, labels of the wrong shape, row counts -----------------------------------


class _Plant:
    """Unpickling it would create the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_npy(folder: Path, n: int = 6, labels: np.ndarray | None = None) -> Path:
    np.save(folder / "day_dense.npy", np.zeros((n, 13), np.float32))
    np.save(folder / "day_sparse.npy", np.zeros((n, 26), np.int64))
    np.save(folder / "day_labels.npy", np.ones((n, 1), np.int32) if labels is None else labels)
    return folder / "day_dense.npy"


def test_pickled_dense_npy_is_never_unpickled(tmp_path: Path) -> None:
    dense = write_npy(tmp_path)
    marker = tmp_path / "unpickled"
    objs = np.empty((6, 13), dtype=object)
    objs[:] = 0
    objs[0, 0] = _Plant(str(marker))
    np.save(dense, objs, allow_pickle=True)
    for world_size in (1, 2):
        with pytest.raises(
            BadInputError, match=r"day_dense.npy: not a numeric .npy array .*never loaded \(allow_pickle=False\)"
        ):
            list(CriteoNpyReader(CriteoReaderConfig(paths=[str(dense)], world_size=world_size)))
    assert not marker.exists()


def test_npy_labels_of_shape_n_by_2_name_the_file_and_shapes(tmp_path: Path) -> None:
    dense = write_npy(tmp_path, labels=np.ones((6, 2), np.int32))
    for world_size in (1, 2):
        reader = CriteoNpyReader(CriteoReaderConfig(paths=[str(dense)], world_size=world_size))
        with pytest.raises(
            BadInputError,
            match=r"day_labels.npy: shape \[6, 2\], expected \[N\] or \[N, 1\] .*"
            r"day_dense.npy has N = 6",
        ):
            list(reader)
        assert reader.stats.rows == 0
    reader = CriteoNpyReader(CriteoReaderConfig(paths=[str(write_npy(tmp_path, labels=np.ones(6, np.float32)))]))
    assert int0(reader).shape == (6,) and reader.stats.rows == 6  # [N] labels are fine


def test_npy_row_counts_that_differ_name_the_files(tmp_path: Path) -> None:
    dense = write_npy(tmp_path)
    np.save(tmp_path / "day_sparse.npy", np.zeros((5, 26), np.int64))
    with pytest.raises(
        BadInputError,
        match=r"row counts differ: .*day_dense.npy has 6 rows, .*day_sparse.npy 5, "
        r".*day_labels.npy 6",
    ):
        list(CriteoNpyReader(CriteoReaderConfig(paths=[str(dense)])))
