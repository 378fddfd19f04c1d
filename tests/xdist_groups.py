"""The work units of ``--dist loadgroup`` (``make test``, ``make interop``), scheduled by this
repository rather than by pytest-xdist's own ``LoadGroupScheduling``.

xdist 3.8 tells the controller a test's ``xdist_group`` by renaming the test (``nodeid@group``,
``item._nodeid``); pytest 9 keeps a node's id elsewhere, so that rename does nothing and every
test was scheduled on its own (as ``--dist load``): a module's or a version's tests went to
both processes, and each started the session and module children it needed (a second SGLang
decode per version, a second vLLM import per decode, ~50 s each). Here the processes write
each test's unit to a file (a folder the controller names in ``workerinput``) as they finish
collecting, and the controller's ``GroupScheduling`` reads it: a unit goes to one process
whole, the costliest unit first, so that the run does not end on a long unit started last.

A unit's cost is its seconds in ``tests/xdist_costs.json`` (each test's setup, call and
teardown, summed: measured by a run with ``PW_XDIST_COSTS_OUT=tests/xdist_costs.json``, which
updates the units that run saw), else its number of tests (a second each) up to
``MIN_RECORDED_S``, the least a recorded unit took. Without xdist (``-n 0``) nothing here
runs."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_DIR = "pw_xdist_groups"  # the workerinput key: where the processes write their units
COSTS = Path(__file__).with_name("xdist_costs.json")  # measured seconds per unit
MIN_RECORDED_S = 2.0  # a unit quicker than this is left out of the table (its cost: below)


def work_units(
    items: Sequence[pytest.Function], shared_children: Sequence[str]
) -> dict[str, tuple[str, float]]:
    """Each test's (unit, cost). A unit: all of one SGLang version's tests (they share that
    version's decode process, and the last of them kills it; a module fixture of theirs is
    started per version anyway, pytest runs a version's tests together); else a module with
    every shared child its tests use and every other module using one of those (so each
    module fixture and each shared child starts once), named after its first shared child or
    its module. Cost: 1 a test, 0 one skipped at collection (an older version's
    ``newest_sglang`` tests)."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        parent.setdefault(key, key)
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    keys = {}
    for item in items:
        if "sglang_version" in item.fixturenames:  # a session fixture with a param per version
            keys[item.nodeid] = f"sglang-{item.callspec.params['sglang_version']}"
            continue
        module = item.nodeid.split("::")[0]
        keys[item.nodeid] = module
        for name in shared_children:
            if name in item.fixturenames:
                parent[root(module)] = root(name)  # the shared child names the unit
    # A unit with shared children is named after the first of them in ``shared_children``,
    # whatever order the union went in (the name keys its cost in tests/xdist_costs.json).
    names: dict[str, str] = {}
    for name in reversed(shared_children):
        if name in parent:
            names[root(name)] = name
    units = {}
    for item in items:
        skipped = any(mark.name == "skip" for mark in item.iter_markers())
        key = root(keys[item.nodeid])
        units[item.nodeid] = (names.get(key, key), 0.0 if skipped else 1.0)
    return units


def write_units(config: pytest.Config, units: dict[str, tuple[str, float]]) -> None:
    """In an xdist process: each test's (unit, cost) for the controller, written before the
    process reports its collection (so the file is whole when the controller schedules)."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    directory = workerinput.get(GROUPS_DIR) if workerinput else None
    if directory is None:
        return
    target = Path(directory) / f"{workerinput['workerid']}.json"  # type: ignore[index]
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(units))
    os.replace(partial, target)


class Controller:
    """The controller's side: names the folder, makes the scheduler, records what each unit
    took when asked (``PW_XDIST_COSTS_OUT``), removes the folder."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.durations: defaultdict[str, float] = defaultdict(float)  # per test, its phases

    def configure_node(self, node: Any) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="pw-xdist-units-"))
        node.workerinput[GROUPS_DIR] = str(self.directory)

    def make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "loadgroup":
            return None
        return GroupScheduling(config, log, self)

    def units(self) -> dict[str, tuple[str, float]]:
        """The first process's units (every process collected the same tests: xdist checks)."""
        assert self.directory is not None
        files = sorted(self.directory.glob("*.json"))
        if not files:
            return {}
        found: dict[str, list[Any]] = json.loads(files[0].read_text())
        return {nodeid: (unit, float(cost)) for nodeid, (unit, cost) in found.items()}

    def record(self, nodeid: str, duration_s: float) -> None:
        self.durations[nodeid] += duration_s

    def close(self) -> None:
        """``PW_XDIST_COSTS_OUT``: the units this run measured, written over their old costs."""
        out = os.environ.get("PW_XDIST_COSTS_OUT")
        if self.directory is None:
            return
        if out and self.durations:
            units = self.units()
            measured: defaultdict[str, float] = defaultdict(float)
            for nodeid, seconds in self.durations.items():
                measured[units.get(nodeid, (nodeid.split("::")[0], 0.0))[0]] += seconds
            costs = read_costs(Path(out))
            for unit, seconds in measured.items():
                costs.pop(unit, None)
                if seconds >= MIN_RECORDED_S:
                    costs[unit] = round(seconds)
            Path(out).write_text(json.dumps(dict(sorted(costs.items())), indent=1) + "\n")
        shutil.rmtree(self.directory, ignore_errors=True)


def read_costs(path: Path = COSTS) -> dict[str, float]:
    return dict(json.loads(path.read_text())) if path.exists() else {}


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """xdist's scope scheduling with this repository's units, the costliest first."""

    def __init__(self, config: pytest.Config, log: Any, controller: Controller) -> None:
        super().__init__(config, log)
        self._controller = controller
        self._units: dict[str, tuple[str, float]] | None = None
        self._costs = read_costs()

    def schedule(self) -> None:
        if self._units is None and self.collection_is_completed:
            self._units = self._controller.units()
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        found = (self._units or {}).get(nodeid)
        return found[0] if found else nodeid.split("::")[0]

    def _cost(self, scope: str) -> float:
        """Its measured seconds, else its number of tests (not those skipped at collection)
        up to ``MIN_RECORDED_S``: a unit that a run measured quicker than that is left out
        of the table, and 150 quick unit tests must not go before a minute of interop."""
        if scope in self._costs:
            return self._costs[scope]
        units = self._units or {}
        count = sum(units.get(nodeid, ("", 1.0))[1] for nodeid in self.workqueue[scope])
        return min(count, MIN_RECORDED_S)

    def _assign_work_unit(self, node: Any) -> None:
        """The costliest unit left (the first of equals, in collection order) to ``node``."""
        scope = max(self.workqueue, key=self._cost)
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)
