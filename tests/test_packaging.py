"""Packaging: the dependency metadata states supported ranges (exact pins only in
requirements/*.txt), the console scripts run the launch/ functions, and the shipped configs
are found by name (docs/install.md)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from comera_rec.config import ConfigError, load_config, resolve_config, run_config_from_args, shipped_configs

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# The supported matrix of docs/install.md: per distribution, versions that must be inside
# the declared range (the verified sets) and versions that must be outside it (unsupported).
SUPPORTED = {
    "torch": {"inside": ["2.13.0", "2.13.0+cpu", "2.14.1"], "outside": ["2.12.1", "2.15.0", "3.0"]},
    "torchrec": {"inside": ["1.9.2"], "outside": ["1.8.0", "1.9.1", "1.10.0", "2.0"]},
    "fbgemm-gpu": {"inside": ["1.8.0", "1.9.0"], "outside": ["1.7.0", "1.10.0", "2.0"]},
    "fbgemm-gpu-cpu": {"inside": ["1.8.0", "1.9.0"], "outside": ["1.7.0", "1.10.0"]},
}
# torch (major, minor) -> the fbgemm (major, minor) built against it
ABI_PAIRS = {(2, 13): (1, 8), (2, 14): (1, 9)}
# torch pins its own triton on CUDA machines: an exact pin here could fight it
NEVER_EXACT = set(SUPPORTED) | {"triton"}
SCRIPTS = {
    "comera-train-dlrm": ("comera_rec.dlrm.cli:main", "launch.train_dlrm", "comera_rec.dlrm.cli", "train"),
    "comera-train-transformer": (
        "comera_rec.transformer.cli:main",
        "launch.train_transformer",
        "comera_rec.transformer.cli",
        "train",
    ),
    "comera-bench": ("comera_rec.dlrm.bench:main", "launch.bench_dlrm", "comera_rec.dlrm.bench", "main"),
    "comera-bench-rank": ("comera_rec.dlrm.bench_rank:main", "launch.bench_rank", "comera_rec.dlrm.bench_rank", "main"),
    "comera-predict-dlrm": (
        "comera_rec.dlrm.predict:main",
        "launch.predict_dlrm",
        "comera_rec.dlrm.predict",
        "predict_cli",
    ),
}


def _requirements() -> list[tuple[str, Requirement]]:
    """Every requirement of the project metadata, with where it is (dependencies or an extra)."""
    project = PYPROJECT["project"]
    reqs = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, items in project.get("optional-dependencies", {}).items():
        reqs += [(f"extra {extra}", Requirement(r)) for r in items]
    return reqs


def _pins(path: Path) -> dict[str, Version]:
    """``name==version`` lines of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = Version(m.group(2))
    return pins


def test_no_exact_pin_of_torch_torchrec_fbgemm_or_triton_in_the_metadata() -> None:
    for where, req in _requirements():
        if req.name.lower() in NEVER_EXACT:
            exact = [s for s in req.specifier if s.operator in ("==", "===")]
            assert not exact, f"{where}: {req} pins {req.name} exactly; pins belong in requirements/*.txt"


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_core_dependency_ranges_state_the_supported_matrix(name: str) -> None:
    declared = [(where, r) for where, r in _requirements() if r.name.lower() == name]
    if name == "fbgemm-gpu-cpu":  # reached through the shim (or fbgemm-gpu on GPUs), not declared
        assert not declared, "fbgemm-gpu-cpu is pulled by third_party/fbgemm-gpu-shim, not the project"
        return
    assert [w for w, _ in declared] == ["dependencies"], f"{name} must be a dependency, once: {declared}"
    spec = declared[0][1].specifier
    ops = {s.operator for s in spec}
    assert ">=" in ops and "<" in ops, f"{name}{spec}: give both a lower and an upper bound"
    for v in SUPPORTED[name]["inside"]:
        assert spec.contains(v, prereleases=True), f"{name}{spec} leaves out the supported {v}"
    for v in SUPPORTED[name]["outside"]:
        assert not spec.contains(v, prereleases=True), f"{name}{spec} lets in the unsupported {v}"


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_the_verified_sets_are_exact_pins_inside_the_ranges(kind: str) -> None:
    pins = _pins(ROOT / "requirements" / f"{kind}.txt")
    declared = {r.name.lower(): r.specifier for _, r in _requirements()}
    assert {"torch", "torchrec"} <= set(pins), f"requirements/{kind}.txt must pin torch and torchrec"
    assert {"fbgemm-gpu", "fbgemm-gpu-cpu"} & set(pins), f"requirements/{kind}.txt must pin fbgemm"
    for name, version in pins.items():
        if name in declared:
            assert declared[name].contains(version, prereleases=True), (
                f"requirements/{kind}.txt pins {name}=={version}, outside pyproject's {name}{declared[name]}"
            )
    # torch and fbgemm must match (ABI)
    fbgemm = pins.get("fbgemm-gpu", pins.get("fbgemm-gpu-cpu"))
    assert ABI_PAIRS[pins["torch"].release[:2]] == fbgemm.release[:2], (pins["torch"], fbgemm)


def test_the_cpu_shim_is_a_supported_fbgemm_gpu() -> None:
    shim = tomllib.loads((ROOT / "third_party/fbgemm-gpu-shim/pyproject.toml").read_text())["project"]
    spec = next(r.specifier for _, r in _requirements() if r.name.lower() == "fbgemm-gpu")
    assert shim["name"] == "fbgemm-gpu" and spec.contains(shim["version"])
    assert shim["dependencies"] == [f"fbgemm-gpu-cpu=={shim['version']}"]
    assert _pins(ROOT / "requirements/cpu.txt")["fbgemm-gpu-cpu"] == Version(shim["version"])


# ------------------------------------------------------------------------------ console scripts


def test_console_scripts_are_declared() -> None:
    declared = PYPROJECT["project"]["scripts"]
    for name, (target, *_) in SCRIPTS.items():
        assert declared.get(name) == target, f"[project.scripts] {name} = {declared.get(name)!r}, not {target!r}"


@pytest.mark.parametrize("name", sorted(PYPROJECT["project"]["scripts"]))
def test_console_script_target_runs_help(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module, func = PYPROJECT["project"]["scripts"][name].split(":")
    entry = getattr(importlib.import_module(module), func)
    assert callable(entry)
    monkeypatch.setattr("sys.argv", [name, "--help"])  # as the console script calls it: no arguments
    with pytest.raises(SystemExit) as exit_info:
        entry()
    assert exit_info.value.code in (0, None)
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_launch_file_runs_the_same_function(name: str) -> None:
    _, launch_module, lib_module, func = SCRIPTS[name]
    assert importlib.import_module(launch_module).main is getattr(importlib.import_module(lib_module), func)


def test_train_console_main_exits_zero_not_with_the_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    # a console script does sys.exit(main()): a returned dict would print it and exit 1
    import comera_rec.dlrm.cli

    monkeypatch.setattr(comera_rec.dlrm.cli, "train", lambda argv=None: {"val_auc": 0.8})
    assert comera_rec.dlrm.cli.main([]) == 0


# ------------------------------------------------------------------------------ configs by name


def test_every_config_is_shipped_by_name() -> None:
    on_disk = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert list(shipped_configs()) == on_disk
    # the package-data pattern that puts them in the wheel, through the comera_rec/configs link
    assert "configs/*.yaml" in PYPROJECT["tool"]["setuptools"]["package-data"]["comera_rec"]
    assert (ROOT / "comera_rec" / "configs").resolve() == (ROOT / "configs").resolve()


@pytest.mark.parametrize("name", ["dlrm_demo", "dlrm_demo.yaml"])
def test_a_bare_name_is_a_shipped_config(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not the repository root: found as package data, not as ./configs
    path = resolve_config(name)
    assert path.name == "dlrm_demo.yaml"
    assert path.read_text() == (ROOT / "configs/dlrm_demo.yaml").read_text()


def test_a_path_is_used_as_it_is_and_a_local_file_wins_over_a_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from comera_rec.dlrm.task import DLRMRunConfig

    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  max_steps: 7\n")
    assert resolve_config(mine) == mine
    assert load_config(DLRMRunConfig, str(mine)).trainer.max_steps == 7
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dlrm_demo.yaml").write_text("trainer:\n  max_steps: 3\n")
    assert resolve_config("dlrm_demo.yaml") == Path("dlrm_demo.yaml")
    assert load_config(DLRMRunConfig, "dlrm_demo.yaml").trainer.max_steps == 3
    assert load_config(DLRMRunConfig, "dlrm_demo").trainer.max_steps == 1500  # no such file: the shipped one


def test_an_unknown_name_lists_the_shipped_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from comera_rec.dlrm.task import DLRMRunConfig

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown config 'dlrm_dmeo'.*available: .*dlrm_demo, dlrm_demo_dense"):
        resolve_config("dlrm_dmeo")
    with pytest.raises(FileNotFoundError, match=r"nowhere/dlrm_demo.yaml does not exist.*dlrm_demo"):
        resolve_config("nowhere/dlrm_demo.yaml")
    # on the command line: a usage error (exit 2) naming them
    with pytest.raises(SystemExit) as exit_info:
        run_config_from_args(DLRMRunConfig, ["--config", "dlrm_dmeo"], None)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown config 'dlrm_dmeo'" in err and "transformer_synthetic" in err


def test_the_command_line_takes_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from comera_rec.dlrm.task import DLRMRunConfig

    monkeypatch.chdir(tmp_path)
    by_name = run_config_from_args(DLRMRunConfig, ["--config", "dlrm_demo", "trainer.max_steps=20"], None)
    by_path = run_config_from_args(
        DLRMRunConfig, ["--config", str(ROOT / "configs/dlrm_demo.yaml"), "trainer.max_steps=20"], None
    )
    assert by_name == by_path and by_name.trainer.max_steps == 20
