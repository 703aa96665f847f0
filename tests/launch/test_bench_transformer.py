"""The transformer benchmark's command line (launch/bench_transformer.py): options that would
be ignored are refused by name."""

from __future__ import annotations

import pytest

from launch.bench_transformer import main


def test_dropout_without_compile_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--dropout", "0"])
    assert "--dropout sets the encoder's dropout for --compile only" in capsys.readouterr().err
