"""The import graph the layer test reads (tests/import_graph.py), on a small package written
here: every kind of import it must see, and the cycle it must find."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import import_graph

FILES = {
    "__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\n",
    "a.py": "from . import b\nimport zmq\n",
    "b.py": "def later():\n    from pkg.c import name\n    return name\n",
    "c.py": (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from .sub import thing\n"
        "if TYPE_CHECKING:\n    import pkg.a\n"
    ),
    "sub/__init__.py": "from ..d import y\nthing = y\n",
    "d.py": "import importlib\ny = 1\nimportlib.import_module('pkg.e')\n",
    "e.py": "E = 1\n",
    "f.py": "import pkg.sub.missing\n",
}


@pytest.fixture
def graph(tmp_path: Path) -> import_graph.Graph:
    root = tmp_path / "pkg"
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return import_graph.build(root, "pkg")


def test_every_kind_of_import_is_an_edge(graph: import_graph.Graph) -> None:
    assert graph == {
        "pkg": {"pkg.e"},  # under TYPE_CHECKING
        "pkg.a": {"pkg.b"},  # a submodule imported by name, relatively; zmq is not a node
        "pkg.b": {"pkg.c"},  # inside a function
        "pkg.c": {"pkg.sub", "pkg.a"},  # a name of a package: its __init__
        "pkg.sub": {"pkg.d"},  # two dots up from a package's __init__
        "pkg.d": {"pkg.e"},  # importlib.import_module with a literal name
        "pkg.e": set(),
        "pkg.f": {"pkg.sub"},  # a module that does not exist: its deepest existing parent
    }


def test_a_cycle_is_found_and_shown_as_a_path(graph: import_graph.Graph) -> None:
    assert import_graph.cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert import_graph.components_with_cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_a_self_import_is_no_edge_and_no_cycle(tmp_path: Path) -> None:
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "__init__.py").write_text("from solo import x\nx = 1\n")
    graph = import_graph.build(tmp_path / "solo", "solo")
    assert graph == {"solo": set()} and import_graph.cycles(graph) == []


def test_reach_gives_one_path_to_every_module_reached(graph: import_graph.Graph) -> None:
    reached = import_graph.reach(graph, "pkg.b")
    assert sorted(reached) == ["pkg.a", "pkg.c", "pkg.d", "pkg.e", "pkg.sub"]
    assert reached["pkg.d"] == ["pkg.b", "pkg.c", "pkg.sub", "pkg.d"]
    assert import_graph.in_package(reached, "pkg.sub") == ["pkg.sub"]
