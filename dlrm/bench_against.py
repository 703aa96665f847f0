"""This code's training step against an earlier revision's, side by side on one host
(:mod:`comera_rec.dlrm.bench`, ``--against REV``).

A speed-up measured on one host and day says little on another: these shared hosts move
by up to 1.6x between neighbouring processes, and a goal set on one CPU (a ratio against
dense TorchRec) may sit above what another CPU gives any version of the code. Whether a
change slowed the step is answered by running both codes on the same host in the same
minutes: a git worktree of ``REV`` is checked out next to this checkout, and each variant
trains in fresh processes of either code, the two codes alternating, each process running
that code's own benchmark model (its own ``run_in_process``), its kernels built by that
code.

Both codes share this interpreter and its packages (torch, TorchRec, FBGEMM): the
comparison is of the project's code only.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from comera_rec.dlrm.bench_process import paired_speedups, round_order
from comera_rec.utils.benchmark import fmt_bytes

THIS = "this code"

# Runs in a fresh interpreter: argv = tree, variant, setup fields as JSON. It imports the
# project from `tree` first and runs that code's own benchmark process: since 2026-11-26 in
# comera_rec.dlrm.bench (re-exported there after later splits), before in launch/bench_dlrm.py. The layout
# is read from the files, not found by trying imports: an editable install's import hook
# would answer a module that `tree` lacks with this checkout's.
CHILD = r"""
import json, sys
from pathlib import Path
tree, variant, fields = Path(sys.argv[1]).resolve(), sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, str(tree))
if (tree / "comera_rec" / "dlrm" / "bench.py").exists():
    from comera_rec.dlrm.bench import Setup, run_in_process
else:
    sys.path.insert(0, str(tree / "launch"))
    from bench_dlrm import Setup, run_in_process
source = Path(sys.modules[run_in_process.__module__].__file__).resolve()
if tree not in source.parents:
    sys.exit(f"the benchmark came from {source}, not from {tree}")
result = run_in_process(variant, Setup(**fields), False)
print("RESULT " + json.dumps({"step_s": result["step_s"], "peak": result["peak"]}), flush=True)
"""


@dataclass
class AgainstRuns:
    """What :func:`against_rounds` measured, each ``{code: {variant: [one value per round]}}``."""

    steps: dict[str, dict[str, list[float]]]
    """Each process's median training step, in seconds."""
    peaks: dict[str, dict[str, list[int]]]
    """Each process's peak resident memory, in bytes."""


def checkout_root() -> Path:
    """The git checkout this package is imported from.

    Raises:
        RuntimeError: the package is not in a git checkout (an installed wheel): there is no
            history to check a revision out of.
    """
    here = Path(__file__).resolve().parent
    found = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True)
    if found.returncode != 0:
        raise RuntimeError(f"--against needs a git checkout of comera-rec; {here} is not in one")
    return Path(found.stdout.strip())


def resolve_revision(repo: Path, revision: str) -> str:
    """``revision``'s full commit hash in ``repo``.

    Raises:
        ValueError: ``revision`` names no commit there.
    """
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], cwd=repo, capture_output=True, text=True
    )
    if found.returncode != 0 or not found.stdout.strip():
        raise ValueError(f"revision {revision!r} is not a commit of {repo}")
    return found.stdout.strip()


@contextmanager
def revision_tree(repo: Path, revision: str) -> Iterator[Path]:
    """A detached git worktree of ``revision`` in a temporary folder, removed on exit
    (worktree entry and files).

    Args:
        repo: a git checkout.
        revision: anything ``git rev-parse`` takes (a hash, a tag, ``HEAD~3``).

    Example::

        >>> with revision_tree(checkout_root(), "HEAD~1") as tree:  # doctest: +SKIP
        ...     (tree / "README.md").exists()
        True
    """
    commit = resolve_revision(repo, revision)
    holder = Path(tempfile.mkdtemp(prefix="comera_against_"))
    tree = holder / commit[:12]
    try:
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(tree), commit],
            cwd=repo,
            check=True,
            capture_output=True,
            text=True,
        )
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)
        shutil.rmtree(holder, ignore_errors=True)


def tree_step(tree: Path, variant: str, fields: dict) -> dict:
    """One fresh process of ``tree``'s code training ``variant`` alone (its benchmark's
    ``run_in_process``, ``Setup(**fields)``): ``{"step_s", "peak"}``.

    Raises:
        RuntimeError: the process gave no result; the end of its error output is in the message.
    """
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), variant, json.dumps(fields)],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},  # no __pycache__ left in either tree
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{variant} at {tree} gave no result (exit {done.returncode}):\n{done.stderr[-3000:]}")


def setup_fields(setup, default, quick: bool) -> dict:
    """The benchmark ``Setup`` fields both codes get: batch size and rank always; the
    memory and interaction switches only where ``setup`` differs from ``default`` (so that
    a revision older than a switch still runs); with ``quick``, the warm-up and timed steps.

    Example::

        >>> from comera_rec.dlrm.bench_setup import Setup
        >>> setup_fields(Setup(batch_size=256, keep_freed_memory=False), Setup(), quick=False)
        {'batch_size': 256, 'rank': 32, 'keep_freed_memory': False}
    """
    fields = {"batch_size": setup.batch_size, "rank": setup.rank}
    for name in ("keep_freed_memory", "fused_interaction"):
        if getattr(setup, name) != getattr(default, name):
            fields[name] = getattr(setup, name)
    if quick:
        fields.update(warmup_steps=setup.warmup_steps, timed_steps=setup.timed_steps)
    return fields


def round_pairs(codes: Sequence[str], names: Sequence[str], round_index: int) -> list[tuple[str, str]]:
    """The (code, variant) processes of round ``round_index``: each variant's processes of
    every code back to back (the two codes of a variant minutes apart at most), the codes'
    order reversed every other round so that neither always runs first.

    Example::

        >>> round_pairs(["old", "new"], ["tt", "dense"], 1)
        [('new', 'tt'), ('old', 'tt'), ('new', 'dense'), ('old', 'dense')]
    """
    return [(code, name) for name in names for code in round_order(tuple(codes), round_index)]


def against_rounds(
    trees: dict[str, Path],
    names: Sequence[str],
    rounds: int,
    fields: dict,
    run: Callable[[Path, str, dict], dict] = tree_step,
    report: Callable[[str], None] = print,
) -> AgainstRuns:
    """Each variant's step and peak RSS in each code's fresh processes, the processes in
    :func:`round_pairs` order.

    Args:
        trees: code label -> checkout to run.
        names: the benchmark's variants (each code must know them).
        rounds: fresh processes per code and variant.
        fields: the ``Setup`` fields both codes take (batch size, rank).
        run: starts one process (:func:`tree_step`; a test passes its own).
        report: gets a line per process as it ends.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    runs = AgainstRuns(
        steps={code: {name: [] for name in names} for code in trees},
        peaks={code: {name: [] for name in names} for code in trees},
    )
    for k in range(rounds):
        for code, name in round_pairs(list(trees), names, k):
            result = run(trees[code], name, fields)
            runs.steps[code][name].append(result["step_s"])
            runs.peaks[code][name].append(result["peak"])
            report(
                f"round {k + 1}: {name} at {code}: {result['step_s'] * 1e3:.2f} ms, peak RSS {fmt_bytes(result['peak'])}"
            )
    return runs


def against_report(runs: AgainstRuns, this: str, other: str) -> list[str]:
    """The comparison's lines: per variant, each code's median step, this code's speed-up
    over the other's (ratio of medians, and the median of the rounds' own ratios), each
    round's ratio; with a ``dense`` variant, each code's speed-up over it; then per variant
    each code's highest peak RSS and this code's share of the other's (above 1: more memory).

    Example::

        >>> runs = AgainstRuns(
        ...     steps={"this": {"tt": [0.02, 0.03]}, "old": {"tt": [0.03, 0.03]}},
        ...     peaks={"this": {"tt": [5, 6]}, "old": {"tt": [4, 4]}},
        ... )
        >>> against_report(runs, "this", "old")[1].split()[:4]
        ['tt', '30.00', '25.00', '1.20x']
        >>> against_report(runs, "this", "old")[-1].split()
        ['tt', '4', 'B', '6', 'B', '1.50x']
    """
    steps = runs.steps
    lines = [
        f"{'variant':10s} {other + ' ms':>16s} {this + ' ms':>16s} {'speed-up':>9s} {'within rounds':>14s}  rounds"
    ]
    for name, mine in steps[this].items():
        theirs = steps[other][name]
        paired = paired_speedups({other: theirs, this: mine}, baseline=other)[this]
        lines.append(
            f"{name:10s} {statistics.median(theirs) * 1e3:16.2f} {statistics.median(mine) * 1e3:16.2f} "
            f"{statistics.median(theirs) / statistics.median(mine):8.2f}x {statistics.median(paired):13.2f}x  "
            + " ".join(f"{r:.2f}" for r in paired)
        )
    if "dense" in steps[this]:
        for code in (other, this):
            dense = statistics.median(steps[code]["dense"])
            lines.append(
                f"{code}: over its own dense processes "
                + ", ".join(
                    f"{name} {dense / statistics.median(times):.2f}x"
                    for name, times in steps[code].items()
                    if name != "dense"
                )
            )
    lines.append(f"{'peak RSS':10s} {other:>16s} {this:>16s} {'this / ' + other:>14s}")
    for name, mine in runs.peaks[this].items():
        theirs = max(runs.peaks[other][name])
        lines.append(f"{name:10s} {fmt_bytes(theirs):>16s} {fmt_bytes(max(mine)):>16s} {max(mine) / theirs:13.2f}x")
    return lines


def against(revision: str, names: Sequence[str], rounds: int, fields: dict) -> None:
    """``--against``: this checkout's benchmark step and ``revision``'s, fresh processes
    alternating (:func:`against_rounds`), then :func:`against_report`."""
    repo = checkout_root()
    commit = resolve_revision(repo, revision)
    print(
        f"this checkout ({repo}) against {revision} ({commit[:12]}), each variant in fresh processes of either "
        f"code, {rounds} rounds; the first process of {revision} builds its kernels (1-3 min, not timed)",
        flush=True,
    )
    with revision_tree(repo, commit) as tree:
        runs = against_rounds(
            {revision: tree, THIS: repo}, names, rounds, fields, report=lambda line: print(line, flush=True)
        )
    print("\n" + "\n".join(against_report(runs, THIS, revision)))
    print(
        f"step: each process's median of its timed steps after its warm-up (each code's own benchmark); "
        f"speed-up: {revision}'s median over this code's; within rounds: the median of each round's ratio; "
        f"peak RSS: the highest of a code's processes of the variant"
    )
