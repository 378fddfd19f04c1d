"""The work units of ``-n N --dist loadgroup`` (``tests/xdist_groups.py``): a unit with shared
children keeps one name whatever order its modules were collected in (the name keys its cost
in ``tests/xdist_costs.json``), and a unit missing from that table costs at most what the
quickest recorded one took."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.xdist_groups import MIN_RECORDED_S, GroupScheduling, work_units

SHARED = ("vllm_decode", "vllm_push_decodes")


@dataclass
class Item:
    nodeid: str
    fixturenames: list[str]
    marks: list[Any] = field(default_factory=list)

    def iter_markers(self) -> list[Any]:
        return self.marks


ITEMS = [
    Item("tests/interop/test_a.py::t", ["vllm_push_decodes"]),
    Item("tests/interop/test_b.py::t", ["vllm_decode", "vllm_push_decodes"]),
    Item("tests/interop/test_c.py::t", ["vllm_decode"]),
    Item("tests/unit/test_d.py::t", ["tmp_path"]),
    Item("tests/unit/test_d.py::u", [], [pytest.mark.skip.mark]),
]


@pytest.mark.parametrize("order", [ITEMS, ITEMS[::-1], ITEMS[1:] + ITEMS[:1]])
def test_a_unit_of_shared_children_is_named_after_the_first_of_them(order: list[Item]) -> None:
    units = work_units(order, SHARED)  # type: ignore[arg-type]
    assert {units[i.nodeid][0] for i in ITEMS[:3]} == {"vllm_decode"}
    assert units["tests/unit/test_d.py::t"] == ("tests/unit/test_d.py", 1.0)
    assert units["tests/unit/test_d.py::u"] == ("tests/unit/test_d.py", 0.0)  # skipped


def test_an_unrecorded_unit_costs_its_tests_up_to_the_least_recorded() -> None:
    scheduler: Any = GroupScheduling.__new__(GroupScheduling)
    scheduler._costs = {"vllm_decode": 292.0}
    scheduler._units = {f"m.py::t{i}": ("m.py", 1.0) for i in range(150)}
    scheduler._units["n.py::t"] = ("n.py", 1.0)
    scheduler.workqueue = {"vllm_decode": {}, "m.py": dict.fromkeys(scheduler._units)}
    scheduler.workqueue["n.py"] = {"n.py::t": False}
    del scheduler.workqueue["m.py"]["n.py::t"]
    assert scheduler._cost("vllm_decode") == 292.0
    assert scheduler._cost("m.py") == MIN_RECORDED_S  # 150 quick tests
    assert scheduler._cost("n.py") == 1.0
