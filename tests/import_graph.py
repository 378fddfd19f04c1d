"""The import graph of a package, read from its source (nothing is imported), and what the
layer rules ask of it: cycles and who reaches whom.

An edge ``a -> b`` means module ``a`` names module ``b`` in an ``import`` statement anywhere
in its file: at module level, inside a function, under ``if TYPE_CHECKING:`` (a cycle there is
still a cycle to a reader), or as the literal argument of ``importlib.import_module``.
Relative imports are resolved against the importing module's package. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module (a submodule imported by name), else to
``pkg`` (its ``__init__``). ``import a.b.c`` is an edge to ``a.b.c`` only: the parent packages
it runs on the way are not edges, so a package face that imports its own submodules is no
cycle. A lazy export (a submodule's name kept in a table and imported on first attribute
access) is not an edge. Only modules of the package itself are nodes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

Graph = dict[str, set[str]]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` (the package's folder), by dotted name."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([package, *parts])] = path
    return found


def build(root: Path, package: str) -> Graph:
    """The graph of every module under ``root`` (``package`` is its dotted name)."""
    files = module_files(root, package)
    return {name: _imports(name, path, files) for name, path in files.items()}


def _imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets.update(_targets(node, here, known))
    targets.discard(name)
    return {t for t in targets if t in known}


def _targets(node: ast.AST, here: str, known: Mapping[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (_deepest_known(alias.name, known) for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(node.module, node.level, here)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            yield submodule if submodule in known else _deepest_known(base, known)
    elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield _deepest_known(first.value, known)


def _is_import_module(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _resolve(module: str | None, level: int, here: str) -> str:
    """``from <level dots><module> import ...`` seen from package ``here``."""
    if level == 0:
        return module or ""
    parts = here.split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _deepest_known(dotted: str, known: Mapping[str, Path]) -> str:
    """``dotted`` itself, or the longest prefix of it that is a module ("" if none is)."""
    parts = dotted.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts)


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle per strongly connected component that has one, each as a path that returns
    to its first module (``[a, b, a]``); components in name order."""
    found = []
    for component in _components(graph):
        members = set(component)
        start = min(members)
        path = _path(graph, start, start, members)
        if path is not None:
            found.append(path)
    return sorted(found)


def components_with_cycles(graph: Graph) -> list[frozenset[str]]:
    """The modules that lie on a cycle, grouped by strongly connected component."""
    return [
        frozenset(c) for c in _components(graph) if len(c) > 1 or c[0] in graph.get(c[0], set())
    ]


def reach(graph: Graph, start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or not, with one import path to each."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        here = todo.pop()
        for there in sorted(graph.get(here, ())):
            if there not in paths:
                paths[there] = [*paths[here], there]
                todo.append(there)
    del paths[start]
    return paths


def in_package(modules: Iterable[str], package: str) -> list[str]:
    """``package`` and its submodules, of ``modules``."""
    return sorted(m for m in modules if m == package or m.startswith(package + "."))


def _path(graph: Graph, src: str, dst: str, within: set[str]) -> list[str] | None:
    """A shortest path ``src -> ... -> dst`` of at least one edge, inside ``within``."""
    parents: dict[str, str] = {}
    frontier = [src]
    while frontier:
        following = []
        for here in frontier:
            for there in sorted(graph.get(here, ())):
                if there not in within or there in parents:
                    continue
                parents[there] = here
                if there == dst:
                    path = [dst]
                    while path[-1] != src or len(path) == 1:
                        path.append(parents[path[-1]])
                    return path[::-1]
                following.append(there)
        frontier = following
    return None


def _components(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            here, edges = work[-1]
            there = next(edges, None)
            if there is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[here])
                if low[here] == index[here]:
                    found.append(_pop_component(here, stack, on_stack))
            elif there not in index:
                index[there] = low[there] = len(index)
                stack.append(there)
                on_stack.add(there)
                work.append((there, iter(sorted(graph.get(there, ())))))
            elif there in on_stack:
                low[here] = min(low[here], index[there])
    return sorted(sorted(c) for c in found)


def _pop_component(root: str, stack: list[str], on_stack: set[str]) -> list[str]:
    component = []
    while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == root:
            return component
