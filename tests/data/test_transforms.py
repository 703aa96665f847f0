"""Transforms: hex parsing, dense log transform, id counting, hashing and vocab remap."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_rec.data.transforms import (
    CategoricalTransform,
    IdCounter,
    dense_transform,
    load_table_sizes,
    parse_hex,
    save_vocabularies,
)


@settings(max_examples=50, deadline=None, database=None)
@given(
    st.lists(
        st.one_of(
            st.integers(0, 2**32 - 1).map(lambda v: f"{v:x}"),
            st.integers(0, 2**32 - 1).map(lambda v: f"{v:08X}"),
            st.just(""),
            st.text("0123456789abcdefxyz-", min_size=1, max_size=10),
        ),
        min_size=1,
        max_size=50,
    )
)
def test_parse_hex_matches_int(values):
    arr = pa.array(values).slice(0)  # also exercise a sliced array below
    raw, missing, bad = parse_hex(arr)
    for v, r, m, b in zip(values, raw, missing, bad):
        ok = 0 < len(v) <= 8 and all(c in "0123456789abcdefABCDEF" for c in v)
        assert m == (v == "") and b == (v != "" and not ok)
        assert r == (int(v, 16) if ok else 0)
    if len(values) > 2:
        raw2, _, _ = parse_hex(pa.array(values).slice(1, len(values) - 2))
        np.testing.assert_array_equal(raw2, raw[1:-1])


def test_dense_transform():
    raw = np.array([[0, 1, -3, 10**9]], np.int64)
    np.testing.assert_allclose(dense_transform(raw), np.log1p([[0, 1, 0, 10**9]]).astype(np.float32))
    assert dense_transform(raw).dtype == np.float32


def test_id_counter_matches_counter():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 50, (3000, 26))
    missing = rng.random((3000, 26)) < 0.1
    c = IdCounter()
    for i in range(0, 3000, 700):
        c.add(raw[i : i + 700], missing[i : i + 700])
    for f in (0, 25):
        ref = collections.Counter(raw[~missing[:, f], f].tolist())
        ids, counts = c.result(f)
        assert dict(zip(ids.tolist(), counts.tolist())) == ref


def test_hashing_and_vocab(tmp_path):
    raw = np.array([[5] * 26, [7] * 26, [0] * 26, [9] * 26], np.int64)
    missing = np.zeros_like(raw, bool)
    missing[2] = True
    h = CategoricalTransform.hashing([4] * 26)(raw, missing)
    assert h[:, 0].tolist() == [1, 3, 0, 1]
    save_vocabularies(tmp_path, [np.array([5, 9])] * 26, frequency_threshold=2)
    assert load_table_sizes(tmp_path) == [4] * 26
    v = CategoricalTransform.from_vocab_dir(tmp_path)(raw, missing)
    assert v[:, 3].tolist() == [2, 1, 0, 3]  # kept 5 -> 2, rare 7 -> 1, missing -> 0, kept 9 -> 3


def test_parse_hex_fixed_width_fast_path():
    values = ["0000000a", "", "ffffffff", "zz123456", "05db9164"]
    raw, missing, bad = parse_hex(pa.array(values))
    assert raw.tolist() == [10, 0, 2**32 - 1, 0, 0x05DB9164]
    assert missing.tolist() == [False, True, False, False, False]
    assert bad.tolist() == [False, False, False, True, False]
