"""The fused CPU kernels' build (kernels/ttm_cpu.py): the lock around it (exclusive_build) and
the ninja it runs (pinned_ninja_on_path)."""

import fcntl
import os
import shutil
import threading
from pathlib import Path

import pytest

from comera_rec.tensor.kernels.ttm_cpu import exclusive_build, pinned_ninja_on_path


def test_stale_cpp_extension_lock_is_removed(tmp_path):
    # what a build killed half-way leaves: cpp_extension would wait on it forever
    (tmp_path / "lock").write_text("")
    with exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert (tmp_path / "comera.flock").exists()


def test_creates_the_build_folder(tmp_path):
    build_dir = tmp_path / "a" / "b"
    with exclusive_build(build_dir):
        assert build_dir.is_dir()


def test_waits_while_another_process_builds(tmp_path):
    entered = threading.Event()
    (tmp_path / "lock").write_text("")  # a live build's lock file: must be left alone while it runs
    with open(tmp_path / "comera.flock", "a+") as other:  # another open file: flock conflicts as across processes
        fcntl.flock(other, fcntl.LOCK_EX)

        def build():
            with exclusive_build(tmp_path):
                entered.set()

        thread = threading.Thread(target=build)
        thread.start()
        assert not entered.wait(0.3), "entered while another holder had the lock"
        assert (tmp_path / "lock").exists()
        (tmp_path / "lock").unlink()  # the other build ends: cpp_extension removes its file
        fcntl.flock(other, fcntl.LOCK_UN)
    thread.join(5)
    assert entered.is_set()


def test_lock_released_after_an_error(tmp_path):
    try:
        with exclusive_build(tmp_path):
            raise RuntimeError("build failed")
    except RuntimeError:
        pass
    with open(tmp_path / "comera.flock", "a+") as probe:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if still held


def test_the_pinned_ninja_is_found_without_the_environment_on_path(monkeypatch):
    ninja = pytest.importorskip("ninja")
    # as under `make`: .venv/bin/python started directly, the venv's bin not on PATH
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pinned_ninja_on_path():
        found = shutil.which("ninja")
        assert found is not None and Path(found).parent == Path(ninja.BIN_DIR)
    assert os.environ["PATH"] == "/usr/bin:/bin"


def test_path_restored_after_an_error(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(RuntimeError, match="build failed"):
        with pinned_ninja_on_path():
            raise RuntimeError("build failed")
    assert os.environ["PATH"] == "/usr/bin:/bin"


def test_no_path_at_all_is_restored_as_none(monkeypatch):
    monkeypatch.delenv("PATH", raising=False)
    with pinned_ninja_on_path():
        assert os.environ["PATH"]  # the pinned ninja's folder
    assert "PATH" not in os.environ
