"""The fused CPU kernels' build (kernels/cpu_extension.py): the lock around it (exclusive_build), the
ninja it runs (pinned_ninja_on_path), and the build at set-up (build_cpu_kernels, run by
``python -m comera_rec.tensor.kernels`` in the Makefile's install step) instead of inside the
first training step. Nothing here compiles: ``cpp_extension.load`` is replaced by a fake."""

import fcntl
import logging
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from comera_rec.tensor import kernels
from comera_rec.tensor.kernels import __main__ as command
from comera_rec.tensor.kernels import cpu_extension
from comera_rec.tensor.kernels.build_support import exclusive_build, pinned_ninja_on_path

ROOT = Path(__file__).resolve().parents[2]


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


# ---------------------------------------------------------------- the build at set-up


class _Built:
    """What the fake build returns: the one call the loader's callers make at once."""

    def vector_bytes(self) -> int:
        return 32


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """``cpp_extension.load`` recorded, not run (it writes the library file a build leaves);
    builds go to ``tmp_path``; the loader's caches are cleared before and after, so that
    the real kernels load again for the tests that follow."""
    calls = []

    def load(name, sources, build_directory, **kwargs):
        calls.append(name)
        Path(build_directory, f"{name}.so").write_bytes(b"")
        return _Built()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_extension.DISABLE_ENV, raising=False)
    monkeypatch.delenv(cpu_extension.VECTOR_BYTES_ENV, raising=False)
    monkeypatch.setattr(cpu_extension, "_enabled", True)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(cpu_extension, "_registered", [])  # the tensor core's build alone (others registered at import)
    cpu_extension.extension.cache_clear()
    cpu_extension.cpu_vector_bytes.cache_clear()
    yield calls
    cpu_extension.extension.cache_clear()
    cpu_extension.cpu_vector_bytes.cache_clear()


def test_the_command_builds_once_with_a_line_before_and_after(fake_build, capsys):
    assert command.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    build_dir = cpu_extension._build_spec()[1]
    assert len(fake_build) == 1 and len(lines) == 2, lines
    assert lines[0].startswith("building the fused CPU kernels for ")
    assert "1-3 min" in lines[0] and "once per machine" in lines[0] and str(build_dir) in lines[0]
    assert re.match(r"built the fused CPU kernels in \d+ s: .*32-byte vectors.*, cached in ", lines[1]), lines[1]
    assert lines[1].endswith(str(build_dir))
    assert kernels.cpu_kernel_enabled() and len(fake_build) == 1  # the first use finds them loaded


def test_built_kernels_are_checked_not_rebuilt(fake_build, capsys):
    name, build_dir, _ = cpu_extension._build_spec()
    build_dir.mkdir(parents=True)
    (build_dir / f"{name}.so").write_bytes(b"")  # newer than the sources
    result = kernels.build_cpu_kernels(print)
    lines = capsys.readouterr().out.splitlines()
    assert result.ready and not result.built and result.vector_bytes == 32 and result.build_dir == build_dir
    assert len(lines) == 1 and lines[0].startswith("the fused CPU kernels are built: ") and str(build_dir) in lines[0]
    assert len(fake_build) == 1  # the loader's check (ninja finds nothing to do)


def test_a_source_newer_than_the_build_is_a_build(fake_build, tmp_path):
    name, build_dir, _ = cpu_extension._build_spec()
    build_dir.mkdir(parents=True)
    library = build_dir / f"{name}.so"
    library.write_bytes(b"")
    assert not cpu_extension._needs_build(name, build_dir)
    old = cpu_extension._SOURCES[0].stat().st_mtime - 10
    os.utime(library, (old, old))
    assert cpu_extension._needs_build(name, build_dir)
    assert cpu_extension._needs_build(name, tmp_path / "nothing here")


def test_registered_extensions_are_built_after_the_tensor_core_s(fake_build, monkeypatch, capsys, tmp_path):
    # the layers above register theirs (DLRM's interaction, the row-wise tables): the tensor core imports none
    source = tmp_path / "other_cpu.cpp"
    source.write_text("")
    other = cpu_extension.CpuExtension("comera_other_cpu", [source], "the other kernels", "the PyTorch path is used")
    assert kernels.register_cpu_extension(other) is other and kernels.register_cpu_extension(other) is other
    assert cpu_extension.registered_cpu_extensions() == (other,)
    assert command.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [name.split("_")[1] for name in fake_build] == ["cpu", "other"] and len(lines) == 4, lines
    assert lines[1].startswith("built the fused CPU kernels in ")
    assert lines[2].startswith("building the other kernels in ") and lines[3].startswith("built the other kernels in ")
    assert other.enabled() and len(fake_build) == 2  # loaded: the first use builds nothing
    monkeypatch.setattr(cpu_extension, "_enabled", False)  # one switch for all the CPU kernels
    assert not other.enabled()


@pytest.mark.parametrize("switch", ["env", "call"])
def test_disabled_kernels_exit_0_with_their_line_and_build_nothing(fake_build, monkeypatch, capsys, switch):
    if switch == "env":
        monkeypatch.setenv(cpu_extension.DISABLE_ENV, "1")
    else:
        monkeypatch.setattr(cpu_extension, "_enabled", False)
    assert command.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the fused CPU kernels are disabled (") and "PyTorch path" in out
    assert out.count("\n") == 1 and fake_build == []
    assert command.main(["--require"]) == 1


def test_no_compiler_exits_0_with_its_line(fake_build, monkeypatch, capsys, caplog):
    def no_compiler(name, **kwargs):
        fake_build.append(name)
        raise RuntimeError("Error building extension 'x': /bin/sh: 1: c++: not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setenv("CXX", "comera-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        assert command.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("building the fused CPU kernels")
    assert lines[-1].startswith("the fused CPU kernels could not be built (no C++ compiler found")
    assert "PyTorch path" in lines[-1] and len(fake_build) == 1
    assert "fused CPU kernels unavailable" in caplog.text  # the loader's warning, with the compiler's error
    assert not kernels.cpu_kernel_enabled() and len(fake_build) == 1  # failed once, not again at first use


def test_a_failed_build_with_a_compiler_names_the_error(fake_build, monkeypatch, capsys):
    def broken(name, **kwargs):
        raise RuntimeError("Error building extension 'x'\nttm_cpu.cpp:1: error: ...")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.setattr(cpu_extension, "_compiler_found", lambda: True)
    result = kernels.build_cpu_kernels(print)
    assert not result.ready
    assert "could not be built (Error building extension 'x')" in capsys.readouterr().out


def test_a_build_at_first_use_logs_how_long_it_may_take(fake_build, caplog):
    # no build at set-up (a source changed since): the call that needs the kernels builds them
    with caplog.at_level(logging.INFO, logger=cpu_extension.__name__):
        assert kernels.cpu_kernel_enabled()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "building the fused CPU kernels" in messages[0]
    assert "1-3 min" in messages[0] and "waits" in messages[0] and "python -m comera_rec.tensor.kernels" in messages[0]
    assert messages[1].startswith("built the fused CPU kernels in ")


def test_the_build_target_is_named(monkeypatch):
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "x86_64")
    for flags, expected in (
        ("fpu sse2 avx avx2 avx512f", "AVX-512 (64-byte vectors)"),
        ("fpu sse2 avx avx2", "AVX2 (32-byte vectors)"),
        ("fpu sse2", "SSE2 (16-byte vectors)"),
    ):
        monkeypatch.setattr(cpu_extension, "_cpu_flags_line", lambda flags=flags: f"flags\t\t: {flags}\n")
        assert cpu_extension._target_description("") == expected
    assert cpu_extension._target_description("64") == f"64-byte vectors ({cpu_extension.VECTOR_BYTES_ENV}=64)"


def test_the_install_rule_builds_the_kernels():
    # make demo / make test reach the kernels through $(STAMP): built there, not in a training step
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M)
    assert rule is not None
    recipe = [line.strip() for line in rule.group(1).splitlines()]
    build = next(i for i, line in enumerate(recipe) if line.startswith("$(PY) -m comera_rec.tensor.kernels"))
    install = next(i for i, line in enumerate(recipe) if line.startswith("$(PY) -m pip install") and " -e " in line)
    assert install < build < recipe.index("touch $(STAMP)")
    for target in ("demo", "test"):
        assert re.search(rf"^{target}: \$\(STAMP\)", makefile, re.M), target


def test_host_description_names_the_isa_the_kernels_target(monkeypatch) -> None:
    """The benchmarks' first line: the instruction set read from the CPU flags, or the width
    forced by COMERA_CPU_VECTOR_BYTES, then the CPU model and the usable cores."""
    monkeypatch.delenv(cpu_extension.VECTOR_BYTES_ENV, raising=False)
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_extension, "_cpu_flags_line", lambda: "flags\t: fpu sse2 avx avx2 fma\n")
    line = cpu_extension.host_description()
    assert line.startswith("AVX2 (32-byte vectors); ") and line.endswith(" cores")
    monkeypatch.setattr(cpu_extension, "_cpu_flags_line", lambda: "flags\t: fpu avx2 avx512f\n")
    assert cpu_extension.host_description().startswith("AVX-512 (64-byte vectors); ")
    monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, "32")  # narrower than this host's: its instruction set
    assert cpu_extension.host_description().startswith(
        "AVX2 code on an AVX-512 host (32-byte vectors, COMERA_CPU_VECTOR_BYTES=32); "
    )
    monkeypatch.setenv(cpu_extension.VECTOR_BYTES_ENV, "64")  # wider: the compiler emulates it
    assert cpu_extension.host_description().startswith("64-byte vectors (COMERA_CPU_VECTOR_BYTES=64); ")


def kernel_sources() -> list[Path]:
    """Every C++ source of the CPU kernels' libraries (the tensor core's and the layers' above)."""
    return sorted(
        {*cpu_extension._SOURCES, *(p for ext in cpu_extension.registered_cpu_extensions() for p in ext.sources)}
    )


def test_kernel_sources_include_the_aten_headers_not_the_whole_frontend():
    # <torch/extension.h> (the C++ frontend, pybind11, Python) took 44 s to parse per source
    # on the 2-core host, aten_ops.h 8-10 s: a source that brought it back would double the build
    import comera_rec.dlrm.interaction_kernel  # noqa: F401  (each registers its library)
    import comera_rec.dlrm.serving_ops  # noqa: F401
    import comera_rec.integration.rowwise_bag_kernel  # noqa: F401

    sources = kernel_sources()
    names = {p.name for p in sources}
    assert {"ttm_cpu.cpp", "interaction_cpu.cpp", "rowwise_bag_cpu.cpp", "serving_ops_cpu.cpp"} <= names, names
    for path in [*sources, *cpu_extension._HEADERS]:
        text = path.read_text()
        if path.name == "python_module.h":  # the frontend only where a torch release lacks the pybind header
            text = text.partition("#else")[0]
            assert "#if __has_include(<torch/csrc/utils/pybind.h>)" in text
        includes = set(re.findall(r"#include [<\"]([^>\"]+)[>\"]", text))
        assert "torch/extension.h" not in includes, f"{path.name} includes <torch/extension.h>"
        if path.suffix == ".cpp":
            assert "aten_ops.h" in includes or "simd.h" in includes, f"{path.name} lacks aten_ops.h"
            # pybind11 only where a Python module is bound
            assert ("python_module.h" in includes) == ("PYBIND11_MODULE" in text), path.name


def test_a_changed_header_names_a_new_build(tmp_path, monkeypatch):
    # cpp_extension rebuilds on a changed source only: each header the sources include is hashed
    assert {p.name for p in cpu_extension._HEADERS} == {"simd.h", "aten_ops.h", "python_module.h"}
    copies = []
    for header in cpu_extension._HEADERS:
        copies.append(tmp_path / header.name)
        shutil.copy(header, copies[-1])
    monkeypatch.setattr(cpu_extension, "_HEADERS", copies)
    before = cpu_extension._source_tag()
    for copy in copies:
        text = copy.read_text()
        copy.write_text(text + "\n// changed\n")
        assert cpu_extension._source_tag() != before, copy.name
        copy.write_text(text)
    assert cpu_extension._source_tag() == before
