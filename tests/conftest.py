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

settings.register_profile("prefill-worker", deadline=None)
settings.load_profile("prefill-worker")
launch.PATIENCE = SCALE  # child processes' start and stop waits (tests/patience.py)

# Session-scoped children that tests of several modules share: one process runs them all, so
# the child starts once (``tests/interop/conftest.py``: vLLM's decode, an import of ~40 s).
SHARED_CHILDREN = ("vllm_decode",)


def xdist_group(item: pytest.Function) -> str:
    """The work unit of a test under ``--dist loadgroup``: all of one SGLang version's tests
    (they share that version's decode process, and the last of them kills it), the tests of
    a shared child, else the test's module (as ``--dist loadfile``)."""
    if "sglang_version" in item.fixturenames:  # a session fixture with a param per version
        return f"sglang-{item.callspec.params['sglang_version']}"
    shared = [name for name in SHARED_CHILDREN if name in item.fixturenames]
    return shared[0] if shared else item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    limit_s = patient(float(config.getini("timeout") or 0))  # pytest-timeout's, per test
    for item in items:
        if isinstance(item, pytest.Function):
            item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
            if limit_s and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(limit_s))
