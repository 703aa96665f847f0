"""``comera_rec.data`` imports its readers, transforms and synthetic generator (pyarrow)
on first use: a process that only builds or scores a model leaves them out of its RSS."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_building_a_model_leaves_pyarrow_out() -> None:
    code = (
        "import sys\n"
        "from comera_rec.dlrm import DLRMConfig, build_dlrm\n"
        "build_dlrm(DLRMConfig.kaggle(), device='meta')\n"
        "print(sorted(m for m in ('pyarrow', 'pandas', 'comera_rec.data.readers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_lazy_names_are_the_modules_own() -> None:
    import comera_rec.data as data
    from comera_rec.data import readers, synthetic, transforms

    assert data.CriteoTsvReader is readers.CriteoTsvReader
    assert data.SyntheticCriteo is synthetic.SyntheticCriteo
    assert data.load_table_sizes is transforms.load_table_sizes
    for name in data.__all__:
        assert getattr(data, name) is not None
    with pytest.raises(AttributeError, match="module 'comera_rec.data' has no attribute 'no_such_name'"):
        data.no_such_name  # noqa: B018
