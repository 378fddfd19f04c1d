"""The layer rule of docs/architecture.md, as a test over the package's import graph.

The graph is read from the source (``tests/import_graph.py`` says what counts as an import:
function-level and ``TYPE_CHECKING`` imports do). Every rule names the modules it is about and
fails, never skips, when one of them does not exist, so a rename cannot quietly switch a rule
off.
"""

from __future__ import annotations

from pathlib import Path

import prefill_worker
from tests import import_graph

PACKAGE = "prefill_worker"
GRAPH = import_graph.build(Path(prefill_worker.__file__).parent, PACKAGE)

# (importer, what it must never reach, directly or through other modules): packages, each
# standing for itself and its submodules.
INGRESS_RULES = (("prefill_worker.ingress", "prefill_worker.scheduler"),)
# The model writes what a transfer reads (its pool, and the mirror a protocol hands it at
# start-up) without knowing any protocol.
MODEL_RULES = (("prefill_worker.model", "prefill_worker.transfer"),)
TRANSFER_RULES = (
    ("prefill_worker.transfer.sglang", "prefill_worker.transfer.native"),
    ("prefill_worker.transfer.native", "prefill_worker.transfer.sglang"),
    ("prefill_worker.transfer.decode", "prefill_worker.transfer.push"),
    ("prefill_worker.transfer.decode", "prefill_worker.transfer.native"),
    ("prefill_worker.transfer.decode", "prefill_worker.transfer.sglang"),
    ("prefill_worker.transfer.push", "prefill_worker.transfer.native"),
    ("prefill_worker.transfer.push", "prefill_worker.transfer.sglang"),
)


def test_no_import_cycle() -> None:
    components = import_graph.components_with_cycles(GRAPH)
    shown = [" -> ".join(import_graph.cycles({m: GRAPH[m] & c for m in c})[0]) for c in components]
    assert not components, "import cycles:\n" + "\n".join(shown)


def test_the_ingress_imports_nothing_of_the_scheduler() -> None:
    _check_rules(INGRESS_RULES)


def test_the_model_imports_nothing_of_the_transfer() -> None:
    _check_rules(MODEL_RULES)


def test_the_transfer_layers() -> None:
    _check_rules(TRANSFER_RULES)


def _check_rules(rules: tuple[tuple[str, str], ...]) -> None:
    _assert_exist({package for rule in rules for package in rule})
    broken = [
        " -> ".join(path)
        for importer, forbidden in rules
        for path in _paths_into(importer, forbidden)
    ]
    assert not broken, "layer rule broken by:\n" + "\n".join(broken)


def _paths_into(importer: str, forbidden: str) -> list[list[str]]:
    """One import path from each module of ``importer`` that reaches ``forbidden``."""
    found = []
    for module in import_graph.in_package(GRAPH, importer):
        reached = import_graph.reach(GRAPH, module)
        for target in import_graph.in_package(reached, forbidden):
            found.append(reached[target])
            break
    return found


def _assert_exist(modules: set[str] | frozenset[str]) -> None:
    missing = sorted(m for m in modules if m not in GRAPH)
    assert not missing, f"the layer rules name modules that do not exist: {missing}"
