"""Readers against an independent parse of the real Criteo sample; sharding; bad input."""

from __future__ import annotations

import gzip
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comera_rec.data.criteo import KAGGLE_NUM_EMBEDDINGS, split_row_range
from comera_rec.data.preprocess import preprocess_tsv_to_parquet
from comera_rec.data.readers import (
    BadInputError,
    CriteoNpyReader,
    CriteoParquetReader,
    CriteoReaderConfig,
    CriteoTsvReader,
)


def _check(got, ref, hash_sizes=None):
    labels, dense, ids = got
    rl, rd, rc = ref
    assert len(labels) == len(rl)
    np.testing.assert_array_equal(labels, rl)
    np.testing.assert_allclose(dense, rd, rtol=1e-6, atol=1e-6)
    expect = rc % np.asarray(hash_sizes)[None, :] if hash_sizes is not None else rc
    np.testing.assert_array_equal(ids, expect)


# -- real sample through every reader path --------------------------------------------------


def test_tsv_matches_reference(sample_path, sample_ref, collect_batches):
    reader = CriteoTsvReader(CriteoReaderConfig(paths=[str(sample_path)], batch_size=64))
    _check(collect_batches(reader), sample_ref)
    assert reader.stats.rows == 200 and reader.stats.bad_lines == 0


def test_tsv_hashing_and_small_chunks(sample_path, sample_ref, collect_batches):
    cfg = CriteoReaderConfig(
        paths=[str(sample_path)], batch_size=7, chunk_bytes=1000, num_embeddings_per_feature=KAGGLE_NUM_EMBEDDINGS
    )
    _check(collect_batches(CriteoTsvReader(cfg)), sample_ref, KAGGLE_NUM_EMBEDDINGS)


def test_gzip_tsv_matches_reference(sample_path, sample_ref, collect_batches, tmp_path):
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(sample_path.read_bytes()))
    reader = CriteoTsvReader(CriteoReaderConfig(paths=[str(gz)], batch_size=50, rank=1, world_size=2))
    got = collect_batches(reader)
    _check(got, tuple(a[100:] for a in sample_ref))


def test_test_txt_layout_without_label(sample_path, collect_batches, ref_parse, tmp_path):
    lines = sample_path.read_text().splitlines()
    test_txt = tmp_path / "test.txt"
    test_txt.write_text("".join(line.split("\t", 1)[1] + "\n" for line in lines))
    reader = CriteoTsvReader(CriteoReaderConfig(paths=[str(test_txt)], batch_size=64))
    assert reader.has_label() is False
    labels, dense, ids = collect_batches(reader)
    rl, rd, rc = ref_parse(test_txt, has_label=False)
    assert (labels == -1).all() and len(labels) == 200
    np.testing.assert_allclose(dense, rd, rtol=1e-6)
    np.testing.assert_array_equal(ids, rc)


def test_parquet_after_preprocessing(sample_path, sample_ref, collect_batches, tmp_path):
    meta = preprocess_tsv_to_parquet([str(sample_path)], str(tmp_path / "pq"), frequency_threshold=1, progress=False)
    pq_path = tmp_path / "pq" / "criteo_sample_200.parquet"
    assert meta["rows_per_file"] == {pq_path.name: 200}
    # raw ids (identity) equal the file's hex values
    _check(
        collect_batches(CriteoParquetReader(CriteoReaderConfig(paths=[str(pq_path)], batch_size=33, chunk_rows=40))),
        sample_ref,
    )
    # contiguous ids through the vocabularies written beside the data
    rl, rd, rc = sample_ref
    distinct = [len(set(rc[rc[:, f] != 0, f])) for f in range(26)]
    assert meta["num_embeddings_per_feature"] == [d + 2 for d in distinct]
    _, _, ids = collect_batches(
        CriteoParquetReader(CriteoReaderConfig(paths=[str(pq_path)], vocab_dir=str(tmp_path / "pq")))
    )
    sizes = np.array(meta["num_embeddings_per_feature"])
    assert (ids < sizes[None, :]).all()
    for f in range(26):
        assert ((ids[:, f] == 0) == (rc[:, f] == 0)).all()  # missing <-> id 0
        present = rc[:, f] != 0
        pairs = set(zip(rc[present, f].tolist(), ids[present, f].tolist()))
        assert len(pairs) == distinct[f] and len({b for _, b in pairs}) == distinct[f]  # a bijection
        assert (ids[present, f] >= 2).all()  # threshold 1: nothing is rare


def test_vocab_frequency_threshold(sample_path, sample_ref, collect_batches, tmp_path):
    meta = preprocess_tsv_to_parquet([str(sample_path)], str(tmp_path), frequency_threshold=5, progress=False)
    _, _, ids = collect_batches(
        CriteoParquetReader(
            CriteoReaderConfig(paths=[str(tmp_path / "criteo_sample_200.parquet")], vocab_dir=str(tmp_path))
        )
    )
    rc = sample_ref[2]
    for f in range(26):
        vals, counts = np.unique(rc[rc[:, f] != 0, f], return_counts=True)
        frequent = set(vals[counts >= 5].tolist())
        assert meta["num_embeddings_per_feature"][f] == len(frequent) + 2
        for raw, i in zip(rc[:, f], ids[:, f]):
            assert i == (0 if raw == 0 else (1 if raw not in frequent else i)) and (raw not in frequent or i >= 2)


def test_npy_torchrec_layout(sample_path, sample_ref, collect_batches, tmp_path):
    # write the layout TorchRec's tsv_to_npys produces: dense log(x - min + 2) float32,
    # sparse raw hex ids, labels int32 [N, 1]
    import csv

    rows = list(csv.reader(open(sample_path, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE))
    dense_int = np.array([[int(v or 0) for v in r[1:14]] for r in rows], np.int64)
    dense = np.log(dense_int - dense_int.min() + 2).astype(np.float32)
    np.save(tmp_path / "day_0_dense.npy", dense)
    np.save(tmp_path / "day_0_sparse.npy", sample_ref[2])
    np.save(tmp_path / "day_0_labels.npy", sample_ref[0].astype(np.int32).reshape(-1, 1))
    cfg = CriteoReaderConfig(
        paths=[str(tmp_path / "day_0_dense.npy")], batch_size=30, chunk_rows=17, rank=0, world_size=1
    )
    labels, d, ids = collect_batches(CriteoNpyReader(cfg))
    np.testing.assert_array_equal(labels, sample_ref[0])
    np.testing.assert_array_equal(d, dense)
    np.testing.assert_array_equal(ids, sample_ref[2])


# -- sharding -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def indexed_files(tmp_path_factory):
    """A 3-file TSV / Parquet / npy set of 307 rows whose int_0 is the global row index."""
    d = tmp_path_factory.mktemp("indexed")
    sizes = [100, 0, 207]
    tsv, npy, start = [], [], 0
    for i, n in enumerate(sizes):
        lines = [
            f"{r % 2}\t{r}" + "\t" * 12 + "\t" + "\t".join(f"{r:x}" for _ in range(26)) for r in range(start, start + n)
        ]
        p = d / f"day_{i}"
        p.write_text("".join(line + "\n" for line in lines))
        tsv.append(str(p))
        np.save(
            d / f"day_{i}_dense.npy",
            np.array([[r] + [0] * 12 for r in range(start, start + n)], np.float32).reshape(n, 13),
        )
        np.save(
            d / f"day_{i}_sparse.npy", np.array([[r] * 26 for r in range(start, start + n)], np.int64).reshape(n, 26)
        )
        np.save(d / f"day_{i}_labels.npy", np.array([r % 2 for r in range(start, start + n)], np.int32).reshape(n, 1))
        npy.append(str(d / f"day_{i}_dense.npy"))
        start += n
    preprocess_tsv_to_parquet(tsv, str(d / "pq"), progress=False, row_group_rows=64)
    pq_paths = [str(d / "pq" / f"day_{i}.parquet") for i in range(3)]
    return {"tsv": tsv, "npy": npy, "parquet": pq_paths, "total": sum(sizes), "sizes": sizes}


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["tsv", "parquet", "npy"]),
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 64),
    split=st.sampled_from(["all", "train", "val", "test"]),
    holdout=st.sampled_from(["kaggle", "last_file"]),
    chunk=st.integers(60, 3000),
)
def test_shards_cover_every_row_once(
    indexed_files, collect_batches, kind, world_size, batch_size, split, holdout, chunk
):
    logging.getLogger("comera_rec").setLevel(logging.ERROR)  # the empty middle file warns
    cls = {"tsv": CriteoTsvReader, "parquet": CriteoParquetReader, "npy": CriteoNpyReader}[kind]
    seen = []
    for rank in range(world_size):
        cfg = CriteoReaderConfig(
            paths=indexed_files[kind],
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            split=split,
            holdout=holdout,
            chunk_bytes=chunk,
            chunk_rows=max(chunk // 40, 1),
        )
        _, dense, ids = collect_batches(cls(cfg))
        idx = ids[:, 0]
        if kind != "npy":
            np.testing.assert_allclose(dense[:, 0], np.log1p(idx), rtol=1e-6)  # columns line up
        seen.append(idx)
    total = indexed_files["total"]
    start, stop = split_row_range(total, indexed_files["sizes"], split, holdout)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(start, stop))


def test_drop_last_gives_equal_batch_counts(indexed_files, collect_batches):
    counts = []
    for rank in range(3):
        cfg = CriteoReaderConfig(
            paths=indexed_files["tsv"],
            batch_size=10,
            rank=rank,
            world_size=3,
            split="train",
            holdout="kaggle",
            drop_last=True,
        )
        counts.append(sum(1 for _ in CriteoTsvReader(cfg)))
    assert counts == [(307 - 307 // 7) // 3 // 10] * 3


def test_splits_do_not_overlap():
    for total in (7, 200, 45_840_617):
        ranges = [split_row_range(total, [total], s, "kaggle") for s in ("train", "val", "test")]
        assert (
            ranges[0][0] == 0
            and ranges[0][1] == ranges[1][0]
            and ranges[1][1] == ranges[2][0]
            and ranges[2][1] == total
        )
        assert ranges[2][1] - ranges[1][0] == total // 7
    assert split_row_range(300, [100, 120, 80], "val", "last_file") == (220, 260)
    assert split_row_range(300, [100, 120, 80], "train", "last_file") == (0, 220)


# -- bad input ------------------------------------------------------------------------------

GOOD = "1\t" + "\t".join(str(i) for i in range(13)) + "\t" + "\t".join(f"{i:08x}" for i in range(26))


def _bad_lines():
    f = GOOD.split("\t")
    return {
        "fields": "\t".join(f[:-1]),  # one field short
        "fields_long": GOOD + "\textra",
        "fields_empty_line": "",
        "int": "\t".join(f[:3] + ["abc"] + f[4:]),
        "int_float": "\t".join(f[:3] + ["1.5"] + f[4:]),
        "hex": "\t".join(f[:20] + ["zz12"] + f[21:]),
        "hex_long": "\t".join(f[:20] + ["123456789"] + f[21:]),
        "label": "\t".join(["2"] + f[1:]),
    }


@pytest.mark.parametrize("kind", list(_bad_lines()))
def test_bad_line_skip_and_strict(kind, tmp_path, collect_batches):
    bad = _bad_lines()[kind]
    p = tmp_path / "day_0"
    p.write_text(GOOD + "\n" + GOOD + "\n" + bad + "\n" + GOOD + "\n")
    reader = CriteoTsvReader(CriteoReaderConfig(paths=[str(p)], batch_size=2, has_label=True))
    labels, dense, ids = collect_batches(reader)
    assert len(labels) == 3 and reader.stats.bad_lines == 1
    assert reader.stats.bad_by_reason == {kind.split("_")[0]: 1}
    # the good rows around the bad one are intact: columns did not shift
    np.testing.assert_allclose(dense, np.log1p(np.arange(13))[None, :].repeat(3, 0), rtol=1e-6)
    np.testing.assert_array_equal(ids, np.arange(26)[None, :].repeat(3, 0))
    with pytest.raises(BadInputError, match=rf"{p.name}:3: "):
        list(CriteoTsvReader(CriteoReaderConfig(paths=[str(p)], bad_input="strict", has_label=True)))


def test_bad_lines_counted_across_chunks(tmp_path, collect_batches, caplog):
    lines = [GOOD] * 300
    for i in range(5, 300, 37):
        lines[i] = _bad_lines()["int"] if i % 2 else _bad_lines()["fields"]
    p = tmp_path / "big.tsv"
    p.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="comera_rec"):
        reader = CriteoTsvReader(
            CriteoReaderConfig(paths=[str(p)], batch_size=64, chunk_bytes=2000, rank=0, world_size=1)
        )
        labels, _, ids = collect_batches(reader)
    n_bad = len(range(5, 300, 37))
    assert reader.stats.bad_lines == n_bad and len(labels) == 300 - n_bad
    assert "skipped" in caplog.text
    with pytest.raises(BadInputError, match=r"big.tsv:6: "):
        list(CriteoTsvReader(CriteoReaderConfig(paths=[str(p)], bad_input="strict", chunk_bytes=2000)))


@pytest.mark.parametrize("gz", [False, True])
def test_empty_file(tmp_path, collect_batches, gz):
    p = tmp_path / ("empty.gz" if gz else "empty.tsv")
    p.write_bytes(gzip.compress(b"") if gz else b"")
    reader = CriteoTsvReader(CriteoReaderConfig(paths=[str(p)]))
    assert len(collect_batches(reader)[0]) == 0 and reader.stats.empty_files == 1
    sharded = CriteoTsvReader(CriteoReaderConfig(paths=[str(p)], world_size=2, rank=1))
    assert len(collect_batches(sharded)[0]) == 0 and sharded.stats.empty_files == 1
    with pytest.raises(BadInputError, match="empty file"):
        list(CriteoTsvReader(CriteoReaderConfig(paths=[str(p)], bad_input="strict")))


@pytest.mark.parametrize("cls", [CriteoTsvReader, CriteoParquetReader])
def test_missing_path_raises(tmp_path, cls):
    missing = tmp_path / "nope" / "train.txt"
    with pytest.raises(FileNotFoundError, match="nope"):
        cls(CriteoReaderConfig(paths=[str(missing)]))


def test_missing_npy_companion_raises(tmp_path):
    np.save(tmp_path / "day_0_dense.npy", np.zeros((2, 13), np.float32))
    with pytest.raises(FileNotFoundError, match="day_0_sparse.npy"):
        CriteoNpyReader(CriteoReaderConfig(paths=[str(tmp_path / "day_0_dense.npy")]))


def test_unknown_layout_raises(tmp_path):
    p = tmp_path / "x.tsv"
    p.write_text("1\t2\t3\n")
    with pytest.raises(BadInputError, match="x.tsv:1: cannot tell the layout: 3 fields"):
        list(CriteoTsvReader(CriteoReaderConfig(paths=[str(p)])))
