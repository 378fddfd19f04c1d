"""The reliability harness: a real worker process, a real decode peer (``KVReceiver`` over
NIXL), routers over real ZMQ, and one health check every scenario ends with.

A scenario::

    from tests.checkpoints import prompt
    from tests.reliability.conftest import Rig, check_healthy

    def test_bad_thing_fails_only_its_request(rig: Rig) -> None:
        room = rig.next_room()
        rig.decode.want(room, 9)                              # the decode asks for the KV
        rid = rig.router.send_prefill(prompt(9, seed=1), room)  # non-blocking; in the ledger
        reply = rig.router.wait([rid])[rid]                   # Result or Reject
        assert reply.status is OutcomeStatus.OK
        ...                                                   # the fault under test
        check_healthy(rig)                                    # always last

Fixtures:

- ``rig``: a worker shared by the tests of one module (restarted if a scenario left it dead)
  and its decode peer; a fresh ``Ledger`` and ``Router`` per test. Use it when the scenario
  leaves the worker's configuration alone and does not kill it.
- ``rig_factory(*settings, env=None)``: a worker of this test's own (``--set`` flags such as
  ``"scheduler.bootstrap_timeout_s=60"``), its decode and a router; killed after the test.

``Rig`` parts: ``worker`` (tests/integration/daemon ``Worker``: ``proc``, ``http()``,
``log()``), ``decode`` (``LiveDecode``), ``router`` (``Router``), ``ledger`` (``Ledger``),
``new_router()`` for more connections (they share the ledger), ``next_room()``,
``metric(name)``, ``procs`` (extra child processes the health check must find alive: append a
decode you start as a process).

``check_healthy(rig)`` asserts, in order: every request the ledger expects an answer for got
one (waits up to ``timeout_s``); a fresh request is served end to end (result ok, a first token,
the decode room DONE); KV pages used, aux rows used and live requests all 0 on /metrics; no
request got more than its replies, no reply came for an id nobody sent, every reply was
readable; the worker, the decode and router pumps and every process in ``rig.procs`` are
alive. Call it at the end of every scenario; a rig whose test passed without calling it fails
at teardown.

The classes and ``check_healthy`` live in ``tests/reliability/harness.py``; this module
re-exports them. ``tests/reliability/decode_process.py`` runs a ``LiveDecode`` as a process of
its own, for scenarios that kill or stop a decode.

Routers and the decode are thread-safe (one lock each, a pump thread each), so a scenario may
drive them from a thread pool. Requests sent on a connection that is then closed or
``reconnect()``ed without an answer are marked abandoned: the ledger does not count them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoints import make_checkpoint
from tests.integration.daemon.conftest import Worker, start_worker, wait_ready
from tests.reliability.harness import (
    VOCAB_SIZE,
    Ledger,
    LiveDecode,
    ProcStats,
    Reply,
    Rig,
    Router,
    check_healthy,
    pool_usage,
    scrape,
    serve_fresh,
)

__all__ = [  # the harness, importable from here as the scenarios always have
    "VOCAB_SIZE",
    "Ledger",
    "LiveDecode",
    "ProcStats",
    "Reply",
    "Rig",
    "Router",
    "SharedWorker",
    "check_healthy",
    "pool_usage",
    "scrape",
    "serve_fresh",
]

# ── fixtures ─────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("reliability-ckpt") / "llama")


class SharedWorker:
    """One worker and decode for a module's scenarios; restarted when a scenario killed it.
    ``settings``: ``--set`` flags for every start of it (a module that needs them overrides
    the ``shared_worker`` fixture)."""

    def __init__(self, workdir: Path, checkpoint: Path, *settings: str) -> None:
        self._workdir, self._checkpoint, self._settings = workdir, checkpoint, settings
        self.worker: Worker | None = None
        self.decode: LiveDecode | None = None

    def get(self) -> tuple[Worker, LiveDecode]:
        if self.worker is None or self.worker.proc.poll() is not None:
            self.close()
            self.worker = start_worker(self._workdir, self._checkpoint, *self._settings)
            wait_ready(self.worker)
            self.decode = LiveDecode(self.worker.bootstrap)
        assert self.decode is not None
        return self.worker, self.decode

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close()
            self.decode = None
        if self.worker is not None:
            self.worker.child.kill()
            self.worker = None


@pytest.fixture(scope="module")
def shared_worker(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[SharedWorker]:
    shared = SharedWorker(tmp_path_factory.mktemp("reliability-worker"), checkpoint)
    yield shared
    shared.close()


def _finish_rig(rig: Rig, request: pytest.FixtureRequest) -> None:
    rig.close_routers()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.passed:
        assert rig.num_health_checks, "the scenario passed without check_healthy(rig)"


@pytest.fixture
def rig(shared_worker: SharedWorker, request: pytest.FixtureRequest) -> Iterator[Rig]:
    worker, decode = shared_worker.get()
    ledger = Ledger()
    made = Rig(worker, decode, Router(worker.ingress, ledger), ledger)
    yield made
    _finish_rig(made, request)


@pytest.fixture
def rig_factory(
    tmp_path: Path, checkpoint: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def factory(*settings: str, env: dict[str, str] | None = None) -> Rig:
        worker = start_worker(tmp_path, checkpoint, *settings, env=env)
        try:
            wait_ready(worker)
            decode = LiveDecode(worker.bootstrap)
        except BaseException:
            worker.child.kill()
            raise
        ledger = Ledger()
        made.append(Rig(worker, decode, Router(worker.ingress, ledger), ledger))
        return made[-1]

    yield factory
    for one in made:
        try:
            _finish_rig(one, request)
        finally:
            one.decode.close()
            for proc in one.procs:
                proc.kill()
            one.worker.child.kill()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keeps the call phase's report on the item, so a rig can tell the test passed."""
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
