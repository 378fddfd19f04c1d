"""Settings for every test: hypothesis without per-example deadlines, and the work units that
pytest-xdist may hand to different processes (``make test`` and ``make interop`` run on two).

These tests run on 2 shared CPU cores, where an example that takes 5 ms alone can take 300 ms
while another process is busy; a deadline would then fail a correct property by the clock.
Speed lives in bench/, not in tests. For the same reason every wait for another process is
``patient``: ``tests/patience.py`` has the one factor (``PW_TEST_TIMEOUT_SCALE``)."""

from __future__ import annotations

import pytest
from hypothesis import settings

from prefill_worker.testing import launch
from tests.patience import SCALE, patient
from tests.xdist_groups import Controller, work_units, write_units

settings.register_profile("prefill-worker", deadline=None)
settings.load_profile("prefill-worker")
launch.PATIENCE = SCALE  # child processes' start and stop waits (tests/patience.py)

# Session-scoped children that tests of several modules share: their tests and those modules
# are one work unit, so that the child (and each module's own children) starts once
# (``tests/interop/conftest.py``: vLLM's decodes, each a vLLM import).
SHARED_CHILDREN = ("vllm_decode", "vllm_push_decodes")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's work unit (``xdist_group``, ``tests/xdist_groups.py``, written for the
    controller's scheduler) and its pytest-timeout limit. Last: after the interop conftest's
    skips, on the order pytest runs the tests in."""
    limit_s = patient(float(config.getini("timeout") or 0))  # pytest-timeout's, per test
    functions = [item for item in items if isinstance(item, pytest.Function)]
    units = work_units(functions, SHARED_CHILDREN)
    for item in functions:
        item.add_marker(pytest.mark.xdist_group(units[item.nodeid][0]))
        if limit_s and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit_s))
    write_units(config, units)


_CONTROLLER = Controller()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    """xdist's controller, per process: where to write its units."""
    _CONTROLLER.configure_node(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    return _CONTROLLER.make_scheduler(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each phase's seconds, for ``PW_XDIST_COSTS_OUT`` (``tests/xdist_groups.py``)."""
    _CONTROLLER.record(report.nodeid, report.duration)


def pytest_unconfigure(config: pytest.Config) -> None:
    _CONTROLLER.close()
