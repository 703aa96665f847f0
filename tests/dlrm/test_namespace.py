"""The DLRM assembly is the package ``comera_rec.dlrm`` (the folder ``dlrm/``, linked as
``comera_rec/dlrm``), never a top-level ``dlrm``: a user's own module of that name is left
alone, and no file of the assembly is imported under two names."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (ROOT / "dlrm").glob("*.py") if p.stem != "__init__")
# the old top-level names of the assembly's modules, in code (an import, a `python -m` string)
OLD_NAME = re.compile(rf"(?<![\w.])dlrm\.({'|'.join(MODULES)})\b")
SOURCES = ("comera_rec", "dlrm", "launch", "tests", "data")


def test_the_package_is_the_checkouts_dlrm_folder() -> None:
    import comera_rec.dlrm

    assert comera_rec.dlrm.__name__ == "comera_rec.dlrm"
    assert Path(comera_rec.dlrm.__file__).resolve() == ROOT / "dlrm" / "__init__.py"
    assert {"cli", "task", "model", "config"} <= set(MODULES)
    for name in MODULES:
        spec = importlib.util.find_spec(f"comera_rec.dlrm.{name}")
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve() == ROOT / "dlrm" / f"{name}.py", (name, spec.origin)


def test_the_folder_is_not_importable_as_a_top_level_dlrm(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the root of a checkout (on sys.path) ``import dlrm`` would load dlrm/ a second
    time, beside comera_rec.dlrm: the package refuses that name."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.delitem(sys.modules, "dlrm", raising=False)
    with pytest.raises(ImportError, match="comera_rec.dlrm"):
        importlib.import_module("dlrm")
    assert "dlrm" not in sys.modules


def test_no_source_names_the_assembly_as_a_top_level_dlrm() -> None:
    """No import of ``dlrm`` or its modules, and no string naming one of them (a ``python -m``
    command; docstrings aside), in the project's Python files (the link comera_rec/dlrm is
    dlrm/, read once)."""
    bad = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    names = [m.group(0) for m in OLD_NAME.finditer(node.value)]
                else:
                    continue
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "dlrm"]
    assert not bad, "the DLRM assembly is comera_rec.dlrm:\n" + "\n".join(bad)


USER_SCRIPT = """
import contextlib, io, sys
import dlrm  # the user's own
assert dlrm.OWNER == "user", dlrm.__file__
import comera_rec.dlrm.cli
from launch.train_dlrm import main as launch_main
assert launch_main is comera_rec.dlrm.cli.train
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        comera_rec.dlrm.cli.main(["--help"])
    except SystemExit as e:
        assert e.code in (0, None), e.code
assert out.getvalue().startswith("usage:"), out.getvalue()[:200]
assert sys.modules["dlrm"] is dlrm and dlrm.OWNER == "user"
twice = sorted(m for m in sys.modules if m.startswith("dlrm."))
assert not twice, twice
print("ok")
"""


def test_a_users_own_dlrm_module_is_left_alone(tmp_path: Path) -> None:
    """A user's ``dlrm`` first on the path is the one ``import dlrm`` gives, and the DLRM
    trainer (the console script's function, and the checkout's launch script) still runs
    in the same process, the checkout's root on the path too."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "dlrm.py").write_text('OWNER = "user"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(user), str(ROOT)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", USER_SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
