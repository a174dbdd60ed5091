"""No import circles in astrai: every module's imports, read statically, point down only.

A cycle that a lazy import (inside a function) keeps from failing at import time is still a
cycle of responsibilities, so imports anywhere in a file count, as do imports of a package
(its __init__.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import astrai

PACKAGE_DIR = Path(astrai.__file__).parent

# Cycles left in place on purpose, each as the set of its modules, with why.
KNOWN_CYCLES: list[frozenset[str]] = []


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at path, for the package whose directory is root."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules among `modules` that the file at path (module `name`) imports anywhere."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from package import module` imports the module; `from module import name`, the
            # module that defines the name.
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found & modules - {name}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every .py file under root."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    return {name: imported_modules(path, name, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of two or more modules, as one loop through it that
    starts and ends at its first module (Tarjan's algorithm, then a path inside the group)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = {stack.pop()}
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_loop(graph, group) for group in groups]


def _loop(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path inside group from its first module back to it (breadth first)."""
    start = min(group)
    paths = {target: [start, target] for target in graph[start] & group}
    while start not in paths:
        paths = {
            target: [*path, target]
            for path in paths.values()
            for target in graph[path[-1]] & group
            if target not in path[1:]
        } | paths
    return paths[start]


def test_astrai_has_no_import_cycle():
    found = [loop for loop in cycles(import_graph(PACKAGE_DIR)) if set(loop) not in KNOWN_CYCLES]
    assert not found, "import cycles in astrai: " + "; ".join(" -> ".join(c) for c in found)


def test_a_cycle_through_a_lazy_relative_import_is_named(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.low import VALUE\n")
    (package / "sub" / "low.py").write_text("def f():\n    from ..top import g\n")
    (package / "top.py").write_text("from pkg.sub import VALUE\n")
    (package / "apart.py").write_text("import pkg.top\n")
    assert cycles(import_graph(package)) == [["pkg.sub", "pkg.sub.low", "pkg.top", "pkg.sub"]]
