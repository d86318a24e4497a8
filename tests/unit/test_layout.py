"""The layout's rules, read from the source (no imports run): the packages import one another
in layers, without cycles, and the torch-free ground floor (``shared/``) reaches up into
nothing. Every import counts, also those inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "engine", "kernels", "services", "sim", "loadtest")
#: Which packages each may import (besides itself): the layers, bottom to top.
ALLOWED = {
    "shared": set(),
    "kernels": {"shared"},
    "engine": {"shared", "kernels"},
    "services": {"shared", "engine", "kernels"},
    "sim": {"shared", "engine", "kernels", "services"},
    "loadtest": {"shared", "engine", "kernels", "services", "sim"},
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name → file, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the project's modules it imports. ``from pkg import sub`` counts the
    submodule alone when ``sub`` is one (not the package's ``__init__`` too)."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(parts + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = subs if all(s in mods for s in subs) else [base, *subs]
            else:
                continue
            deps |= {m for m in map(known, targets) if m and m != name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph(modules())) == []


def test_packages_import_only_the_layers_below():
    graph = import_graph(modules())
    wrong = sorted((m, d) for m, deps in graph.items() for d in deps
                   if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in ALLOWED[m.split(".")[0]])
    assert wrong == []


def test_the_checks_see_a_cycle_and_an_up_import(tmp_path):
    """The rules above fail on a tree that breaks them (so their passing means something)."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "shared" / "__init__.py").write_text("")
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "shared" / "a.py").write_text("def f():\n    from engine.b import g\n")
    (tmp_path / "engine" / "b.py").write_text("from shared import a\n")
    graph = import_graph(modules(tmp_path))
    assert graph["shared.a"] == {"engine.b"} and graph["engine.b"] == {"shared.a"}
    assert cycles(graph) == [["engine.b", "shared.a"]]
