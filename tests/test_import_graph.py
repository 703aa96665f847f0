"""The import graph of ``comera_rec``: no cycle, no arrow upwards between layers, and the
tensor core and rank adaptation free of TorchRec and FBGEMM (the layers of the design notes
and of README's layout table).

The graph is read from the sources with ``ast``; nothing is imported. The DLRM assembly
(the folder ``dlrm/``, linked as ``comera_rec/dlrm``) is read through the link, as
``comera_rec.dlrm``. Every ``import``
counts: at module level, inside functions (lazy imports), under ``TYPE_CHECKING``.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``
(its ``__init__``). The implicit import of a module's parent packages is not an edge.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "comera_rec"

# The layers of comera_rec from the bottom up. A module may import its own layer and the
# layers of lower tiers; the layers of one tier are independent of each other. The data
# pipeline (Criteo files, synthetic batches) feeds the model and knows none of it, so it
# sits beside the TorchRec integration, not above it. The package root (the public
# facade, comera_rec/__init__.py) is above everything.
TIERS: tuple[tuple[str, ...], ...] = (
    ("utils", "config"),  # helpers: no comera_rec import
    ("tensor",),  # the tensor core and its nn layers (TTLinear, TTMEmbeddingBag), kernels
    ("rank",),  # rank adaptation: objective, schedule, truncation
    ("integration", "data"),  # TorchRec integration; the data pipeline
    ("training",),  # the training engine, which knows nothing of the model's kind
    # the applications: transformer models, the DLRM assembly, the sequence model, and their runs
    ("transformer", "dlrm", "sequence"),
    ("", "gpu_check"),  # the package root; the GPU check (runs commands, imports no layer)
)
TIER = {layer: i for i, layers in enumerate(TIERS) for layer in layers}

NO_TORCHREC = ("tensor", "rank")  # layers that must not import these:
TORCHREC_NAMES = ("torchrec", "fbgemm_gpu")
# the entry points built on comera_rec, and the DLRM assembly's name were it top-level
OUTSIDE = ("dlrm", "launch")


def module_files() -> dict[str, Path]:
    """``comera_rec`` module name -> source file."""
    files = {}
    paths = []  # through links to folders (comera_rec/dlrm), which Path.rglob skips before Python 3.13
    for folder, _, names in os.walk(ROOT / PACKAGE, followlinks=True):
        paths += [Path(folder, n) for n in names if n.endswith(".py")]
    for path in sorted(paths):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import in module ``name``'s file ``path``."""
    return imports_in(path.read_text(), name, path.name == "__init__.py", modules, str(path))


def imports_in(
    source: str, name: str, is_package: bool, modules: set[str], filename: str = "<source>"
) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import in the source of module ``name``, made
    absolute: comera_rec modules resolved as the module docstring says, others by their
    full dotted name."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = from_target(node, package)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return found


def from_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from X import ...`` in a module of ``package`` (``X`` may be relative)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_names_imported(
    source: str, name: str, is_package: bool, filename: str = "<source>"
) -> list[tuple[str, str, int]]:
    """``(comera_rec module, name, line)`` of every private name (``_x``; dunders such as
    ``__version__`` are not private) that the source of module ``name`` imports from a
    comera_rec module with ``from ... import``, absolute or relative, at any depth."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = from_target(node, package)
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            continue
        found += [
            (target, alias.name, node.lineno)
            for alias in node.names
            if alias.name.startswith("_") and not alias.name.startswith("__")
        ]
    return found


def layer_of(module: str) -> str:
    """``comera_rec.tensor.contract`` -> ``tensor``; the root package -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def internal_graph() -> dict[str, set[str]]:
    """comera_rec module -> the comera_rec modules it imports."""
    files = module_files()
    modules = set(files)
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m, _ in imports_of(name, path, modules) if m in modules and m != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) in each strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # a shortest way back to the start, inside the component
        start = min(component)
        paths = {start: [start]}
        queue = [start]
        while start not in graph[queue[0]]:
            v = queue.pop(0)
            for w in sorted(graph[v] & component):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        cycles.append(paths[queue[0]] + [start])
    return cycles


def test_the_walker_sees_absolute_relative_and_lazy_imports() -> None:
    """A guard on the walker itself, so that an empty graph cannot pass the checks below."""
    graph = internal_graph()
    assert "comera_rec.tensor.kernels" in graph["comera_rec.tensor.contract"]  # from pkg import module
    assert "comera_rec.tensor.halves" in graph["comera_rec.tensor.kernels.ttm_triton"]
    assert "comera_rec.tensor.kernels.ttm_triton" in graph["comera_rec.tensor.kernels"]  # lazy, in a function
    assert "comera_rec.integration" in graph["comera_rec"]  # lazy, in a function
    assert "comera_rec.dlrm.task" in graph["comera_rec.dlrm.cli"]  # through the link comera_rec/dlrm
    assert "comera_rec.dlrm.model" in graph["comera_rec.dlrm.scaling"]  # lazy, in a function
    modules = {"p", "p.a", "p.b", "p.b.c"}
    source = "import p.a\nfrom . import c, x\nfrom .. import a\ndef f():\n    from p.b.c import y\n"
    assert imports_in(source, "p.b", True, modules) == [
        ("p.a", 1),
        ("p.b.c", 2),
        ("p.b", 2),
        ("p.a", 3),
        ("p.b.c", 5),  # ast.walk: nested ones last
    ]
    assert imports_in("from .c import y\n", "p.b.d", False, modules) == [("p.b.c", 1)]
    assert find_cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    cycles = find_cycles(internal_graph())
    assert not cycles, "import cycles (one per strongly connected group of modules):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_no_upward_import_between_layers() -> None:
    files = module_files()
    modules = set(files)
    unknown = sorted({layer_of(m) for m in modules} - set(TIER))
    assert not unknown, f"layers missing from TIERS: {unknown}"
    bad = []
    for name, path in files.items():
        source = layer_of(name)
        for target, line in imports_of(name, path, modules):
            if target not in modules:
                continue
            layer = layer_of(target)
            if layer != source and TIER[layer] >= TIER[source]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {source or 'root'} imports {target} ({layer or 'root'})")
    assert not bad, "imports up (or sideways) between layers:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", ["all", *NO_TORCHREC])
def test_no_forbidden_third_party_import(layer: str) -> None:
    """No comera_rec module imports the entry points or a top-level ``dlrm`` (the DLRM
    assembly is ``comera_rec.dlrm``); the tensor core and rank adaptation import neither
    TorchRec nor FBGEMM."""
    forbidden = OUTSIDE if layer == "all" else TORCHREC_NAMES
    files = module_files()
    bad = []
    for name, path in files.items():
        if layer != "all" and layer_of(name) != layer:
            continue
        for target, line in imports_of(name, path, set(files)):
            if target.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not bad, f"imports of {', '.join(forbidden)}:\n" + "\n".join(bad)


def test_no_private_name_imported_across_modules() -> None:
    """A module's private names (``_x``) are its own: what another module uses gets a public
    name in the module that defines it (lazy imports count too)."""
    source = "from comera_rec.a import _x, y, __version__\nfrom .b import _z\ndef f():\n    from .. import _w\n"
    assert private_names_imported(source, "comera_rec.p.m", False) == [
        ("comera_rec.a", "_x", 1),
        ("comera_rec.p.b", "_z", 2),
        ("comera_rec", "_w", 4),
    ]
    assert private_names_imported("from torch.utils import _pytree\n", "comera_rec.m", False) == []
    bad = []
    for name, path in module_files().items():
        for module, imported, line in private_names_imported(
            path.read_text(), name, path.name == "__init__.py", str(path)
        ):
            bad.append(f"{path.relative_to(ROOT)}:{line}: imports {imported} from {module}")
    assert not bad, "private names imported across modules (give them a public name where defined):\n" + "\n".join(bad)
