"""The docs name only modules that exist: a doc naming a module that moved or is gone fails.

Checked in ``docs/*.md`` and ``README.md``: every ``prefill_worker/...`` path, every backticked
``*.py`` path of this repository (relative to the repository, to ``prefill_worker/`` or to one of
its packages; a bare file name must exist somewhere in the repository), every dotted
``prefill_worker.x.y`` (a module, or a name its parent module or package face defines), and the
file names of docs/architecture.md's package map, each under the folder it is listed in.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "prefill_worker"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

_BACKTICKED = re.compile(r"`([^`\n]+)`")
_PY = re.compile(r"[\w./-]*\w\.py\b")
_PKG_PATH = re.compile(r"\bprefill_worker/[\w./-]*\w")
_DOTTED = re.compile(r"\bprefill_worker(?:\.\w+)+")
_DESCRIPTION_COLUMN = 25  # in the package map, where a line continues an entry's description


@cache
def _bases() -> dict[str, list[Path]]:
    """First path component -> the folders a path starting with it is relative to."""
    bases: dict[str, list[Path]] = {}
    for folder in [ROOT, *(p.parent for p in PKG.rglob("__init__.py"))]:
        for child in folder.iterdir():
            if child.is_dir() and not child.name.startswith("."):
                bases.setdefault(child.name, []).append(folder)
    return bases


@cache
def _file_names() -> frozenset[str]:
    found = set()
    for top in ("prefill_worker", "tests", "bench", "scripts", "deploy", "examples"):
        found.update(p.name for p in (ROOT / top).rglob("*.py"))
    return frozenset(found)


def _py_path_resolves(path: str) -> bool:
    """A file name or path of this repository exists; a path of another project is not ours."""
    path = path.removeprefix("./")
    if "/" not in path:
        return path in _file_names()
    first = path.split("/", 1)[0]
    if first not in _bases():
        return True  # another project's file (vllm/distributed/kv_events.py, SGLang's)
    folder = path.rsplit("/", 1)[0]
    if "/" in folder and not any((base / folder).is_dir() for base in _bases()[first]):
        return True  # a folder of ours shares the project's name (transfer/vllm, vllm/distributed)
    return any((base / path).is_file() for base in _bases()[first])


def _dotted_resolves(dotted: str) -> bool:
    """``prefill_worker.a.b``: each part a package or module, but the last may be a name its
    parent defines (a class, a function, a lazily exported name)."""
    parts = dotted.split(".")
    path = ROOT
    for i, part in enumerate(parts):
        if path.is_dir() and (path / part / "__init__.py").is_file():
            path = path / part
        elif path.is_dir() and (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
        else:
            if i != len(parts) - 1:
                return False
            source = path / "__init__.py" if path.is_dir() else path
            return re.search(rf"\b{re.escape(part)}\b", source.read_text()) is not None
    return True


def _names(doc: Path) -> list[str]:
    text = doc.read_text()
    missing = []
    for span in _BACKTICKED.findall(text):
        missing += [p for p in _PY.findall(span) if not _py_path_resolves(p)]
    missing += [p for p in _PKG_PATH.findall(text) if not (ROOT / p).exists()]
    missing += [d for d in _DOTTED.findall(text) if not _dotted_resolves(d)]
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_module_a_doc_names_exists(doc: Path) -> None:
    missing = _names(doc)
    assert not missing, f"{doc.name} names modules that do not exist: {sorted(set(missing))}"


def _package_map() -> list[tuple[list[str], str]]:
    """docs/architecture.md's package map: each line's file names, with the folders it is
    under (innermost first, ending with prefill_worker/)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The package", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []  # (column, folder)
    entries = []
    for line in block.splitlines()[1:]:
        column = len(line) - len(line.lstrip(" "))
        if line.strip() and column < _DESCRIPTION_COLUMN:  # an entry, not a description line
            stack = [(c, f) for c, f in stack if c < column]
            folder = re.match(r"(\S+/)(?= |$)", line.lstrip(" "))
            if folder:
                stack.append((column, folder.group(1)))
        folders = ["".join(f for _, f in stack[: i + 1]) for i in range(len(stack))]
        for name in re.findall(r"[\w/]*\w\.py\b", line):
            entries.append(([*reversed(folders)], name))
    return entries


def test_the_package_map_names_files_that_exist() -> None:
    entries = _package_map()
    assert len(entries) > 40, "the package map was not found in docs/architecture.md"
    missing = [
        f"{folders[0]}{name}"
        for folders, name in entries
        if not any((ROOT / folder / name).is_file() for folder in folders)
    ]
    assert not missing, f"docs/architecture.md's package map names missing files: {missing}"
