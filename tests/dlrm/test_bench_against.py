"""The benchmark against an earlier revision (comera_rec/dlrm/bench_against.py, ``--against``)."""

from __future__ import annotations

import subprocess
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from comera_rec.dlrm import bench, bench_against
from comera_rec.dlrm.bench_setup import Setup


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True)
    return done.stdout.strip()


@pytest.fixture
def two_commit_repo(tmp_path: Path) -> Path:
    """A git repository whose file says "first" at HEAD~1 and "second" at HEAD."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "--quiet")
    for text in ("first", "second"):
        (repo / "version.txt").write_text(text)
        git(repo, "add", "version.txt")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "--quiet", "-m", text)
    return repo


def test_revision_tree_checks_out_the_revision_and_removes_it(two_commit_repo: Path) -> None:
    with bench_against.revision_tree(two_commit_repo, "HEAD~1") as tree:
        assert (tree / "version.txt").read_text() == "first"
        assert (two_commit_repo / "version.txt").read_text() == "second"  # the checkout itself untouched
        assert len(git(two_commit_repo, "worktree", "list").splitlines()) == 2
    assert not tree.exists() and not tree.parent.exists()
    assert len(git(two_commit_repo, "worktree", "list").splitlines()) == 1


def test_revision_tree_is_removed_after_an_error(two_commit_repo: Path) -> None:
    with pytest.raises(KeyError):
        with bench_against.revision_tree(two_commit_repo, "HEAD") as tree:
            raise KeyError("inside")
    assert not tree.exists()
    assert len(git(two_commit_repo, "worktree", "list").splitlines()) == 1


def test_a_revision_that_names_no_commit_is_an_error(two_commit_repo: Path) -> None:
    with pytest.raises(ValueError, match="revision 'no-such-branch' is not a commit"):
        bench_against.resolve_revision(two_commit_repo, "no-such-branch")
    head = git(two_commit_repo, "rev-parse", "HEAD")
    assert bench_against.resolve_revision(two_commit_repo, "HEAD") == head


def test_command_line_names_a_bad_revision(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--against", "no-such-revision-of-comera"])
    assert exc.value.code == 2
    assert "--against: revision 'no-such-revision-of-comera' is not a commit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--parts"], "--parts"), (["--ops", "tt"], "--ops"), (["--mlperf", "--steps", "5"], "--mlperf, --steps")],
)
def test_command_line_refuses_other_modes_with_against(capsys, extra: list[str], named: str) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--against", "HEAD", *extra])
    assert exc.value.code == 2
    assert f"not with {named}" in capsys.readouterr().err


def test_checkout_root_is_this_repository() -> None:
    root = bench_against.checkout_root()
    assert (root / "comera_rec" / "dlrm" / "bench_against.py").exists()


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


FAKE_BENCH = """
    from dataclasses import dataclass

    @dataclass
    class Setup:
        batch_size: int = 2048
        rank: int = 32

    def run_in_process(variant, setup, mlperf):
        if variant == "broken":
            raise RuntimeError("this variant does not build")
        return {"step_s": setup.batch_size / 1000 + setup.rank / 1e6 + {LAYOUT}, "peak": len(variant), "base": 0}
"""


def test_each_code_runs_its_own_benchmark_whichever_layout_it_has(tmp_path: Path) -> None:
    # since 2026-11-26: comera_rec.dlrm.bench (which re-exports them from its split modules)
    new = tmp_path / "new"
    write(new / "comera_rec" / "__init__.py", "")
    write(new / "comera_rec" / "dlrm" / "__init__.py", "")
    write(new / "comera_rec" / "dlrm" / "bench.py", "from comera_rec.dlrm.bench_process import Setup, run_in_process\n")
    write(new / "comera_rec" / "dlrm" / "bench_process.py", FAKE_BENCH.replace("{LAYOUT}", "0.5"))
    # before it: the package has no dlrm subpackage and the benchmark is launch/bench_dlrm.py
    old = tmp_path / "old"
    write(old / "comera_rec" / "__init__.py", "")
    write(old / "launch" / "bench_dlrm.py", FAKE_BENCH.replace("{LAYOUT}", "0.25"))

    fields = {"batch_size": 64, "rank": 8}
    assert bench_against.tree_step(new, "tt", fields) == {"step_s": pytest.approx(0.064 + 8e-6 + 0.5), "peak": 2}
    assert bench_against.tree_step(old, "dense", fields) == {"step_s": pytest.approx(0.064 + 8e-6 + 0.25), "peak": 5}
    with pytest.raises(RuntimeError, match="broken at .* gave no result(.|\n)*this variant does not build"):
        bench_against.tree_step(old, "broken", fields)


def test_a_benchmark_imported_from_outside_the_tree_is_refused(tmp_path: Path, monkeypatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "other_bench.py", FAKE_BENCH.replace("{LAYOUT}", "0"))
    tree = tmp_path / "tree"
    write(tree / "comera_rec" / "__init__.py", "")
    write(tree / "launch" / "bench_dlrm.py", "from other_bench import Setup, run_in_process\n")
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))
    with pytest.raises(RuntimeError, match="the benchmark came from .*other_bench.py, not from .*tree"):
        bench_against.tree_step(tree, "tt", {})


def test_setup_fields_pass_only_what_differs_from_the_defaults() -> None:
    default = Setup()
    assert bench_against.setup_fields(default, default, quick=False) == {"batch_size": 2048, "rank": 32}
    quick = replace(default, rank=16, fused_interaction=False, warmup_steps=1, timed_steps=3)
    assert bench_against.setup_fields(quick, default, quick=True) == {
        "batch_size": 2048,
        "rank": 16,
        "fused_interaction": False,
        "warmup_steps": 1,
        "timed_steps": 3,
    }


def test_rounds_alternate_the_codes_and_keep_each_variant_together() -> None:
    assert bench_against.round_pairs(["a", "b"], ["tt", "dense"], 0) == [
        ("a", "tt"),
        ("b", "tt"),
        ("a", "dense"),
        ("b", "dense"),
    ]
    assert bench_against.round_pairs(["a", "b"], ["tt"], 3) == [("b", "tt"), ("a", "tt")]


def test_against_rounds_collects_every_process_in_order() -> None:
    calls: list[tuple[str, str]] = []
    trees = {"old": Path("/old"), "new": Path("/new")}

    def run(tree: Path, name: str, fields: dict) -> dict:
        calls.append((tree.name, name))
        assert fields == {"batch_size": 16}
        return {"step_s": (2.0 if tree.name == "old" else 1.0) * len(calls), "peak": 1000 * len(calls)}

    lines: list[str] = []
    runs = bench_against.against_rounds(trees, ["tt"], 3, {"batch_size": 16}, run=run, report=lines.append)
    assert calls == [("old", "tt"), ("new", "tt"), ("new", "tt"), ("old", "tt"), ("old", "tt"), ("new", "tt")]
    assert runs.steps == {"old": {"tt": [2.0, 8.0, 10.0]}, "new": {"tt": [2.0, 3.0, 6.0]}}
    assert runs.peaks == {"old": {"tt": [1000, 4000, 5000]}, "new": {"tt": [2000, 3000, 6000]}}
    assert len(lines) == 6 and lines[0] == "round 1: tt at old: 2000.00 ms, peak RSS 1000 B"
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bench_against.against_rounds(trees, ["tt"], 0, {}, run=run)


def test_report_gives_this_codes_speed_up_and_each_codes_against_its_dense() -> None:
    mb = 1024 * 1024
    runs = bench_against.AgainstRuns(
        steps={
            "this": {"tt": [0.020, 0.030, 0.025], "dense": [0.060, 0.050, 0.055]},
            "old": {"tt": [0.030, 0.030, 0.040], "dense": [0.050, 0.060, 0.055]},
        },
        peaks={
            "this": {"tt": [300 * mb, 330 * mb, 310 * mb], "dense": [4000 * mb] * 3},
            "old": {"tt": [280 * mb, 300 * mb, 290 * mb], "dense": [4000 * mb, 5000 * mb, 4000 * mb]},
        },
    )
    header, tt, dense, old_line, this_line, peak_header, tt_peak, dense_peak = bench_against.against_report(
        runs, "this", "old"
    )
    assert header.split()[:3] == ["variant", "old", "ms"]
    # medians 30 / 25 ms: 1.20x; the rounds' own ratios 1.50, 1.00, 1.60: median 1.50x
    assert tt.split() == ["tt", "30.00", "25.00", "1.20x", "1.50x", "1.50", "1.00", "1.60"]
    assert dense.split()[:5] == ["dense", "55.00", "55.00", "1.00x", "1.00x"]
    assert old_line == "old: over its own dense processes tt 1.83x"
    assert this_line == "this: over its own dense processes tt 2.20x"
    # the highest process of each code: 330 against 300 MB is 1.10x the memory
    assert peak_header.split() == ["peak", "RSS", "old", "this", "this", "/", "old"]
    assert tt_peak.split() == ["tt", "300.0", "MB", "330.0", "MB", "1.10x"]
    assert dense_peak.split() == ["dense", "4.9", "GB", "3.9", "GB", "0.80x"]
