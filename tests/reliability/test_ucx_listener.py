"""Raw TCP clients on the NIXL/UCX listener (issue #40, finding 7): UCX accepts each
connection and keeps its descriptor until the peer speaks or closes, and lets a closed one go
only as the agent progresses; the worker's push agents were progressed only while writes were
in flight, so every connection a client opened and closed on an idle worker stayed an open
fd for the process's life (300 of 300 here), on to the process limit. Now the idle agent is
progressed every second, the soft fd limit is raised to the hard one at start, and the fds in
use are on /metrics. A client that holds connections open without a word held their fds for
ever too (NIXL 1.5.1 has no bound or idle timeout): the worker now shuts each down once it has
sent nothing for ``transfer.ucx_silent_close_s`` (off for the module's worker, so the first
test proves the progress alone; 2 s for the second's)."""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.transfer.test_bootstrap_guard import listening
from tests.polling import wait_until
from tests.reliability.conftest import SharedWorker
from tests.reliability.harness import Rig, check_healthy

_GRACE_S = 2.0


@pytest.fixture(scope="module")
def shared_worker(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path
) -> Iterator[SharedWorker]:
    workdir = tmp_path_factory.mktemp("ucx-listener-worker")
    shared = SharedWorker(workdir, checkpoint, "transfer.ucx_silent_close_s=0")
    yield shared
    shared.close()


def _num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _ucx_port(rig: Rig) -> int:
    worker = rig.worker
    ours = {int(worker.ingress.rsplit(":", 1)[1]), int(worker.bootstrap.rsplit(":", 1)[1])}
    ours.add(worker.http_port)
    (port,) = {p for _, p in listening(worker.proc.pid)} - ours
    return port


def test_connections_closed_on_the_ucx_listener_give_their_fds_back(rig: Rig) -> None:
    pid = rig.worker.proc.pid
    before = _num_fds(pid)
    port = _ucx_port(rig)
    conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
    wait_until(lambda: _num_fds(pid) >= before + 300, 10, "the worker accepted them")
    for conn in conns:
        conn.close()
    wait_until(lambda: _num_fds(pid) <= before + 5, 10, "the closed connections' fds back")
    # the metric shows it too: not the 300 (the scrape's own connection and the worker's
    # transient ones come and go: 60 against 53 before was seen on a loaded machine)
    assert rig.metric("prefill_worker_process_open_fds") < before + 100
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this test's: what the worker got
    assert rig.metric("prefill_worker_process_max_fds") == hard
    check_healthy(rig)


def test_connections_held_open_without_a_word_are_shut_down(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory(f"transfer.ucx_silent_close_s={_GRACE_S}")
    pid = rig.worker.proc.pid
    before = _num_fds(pid)
    port = _ucx_port(rig)
    conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
    try:
        # the worker ends each one once it has been silent for the grace (the client reads
        # the end of the stream) and UCX lets its fd go: before, all 300 stayed open fds for
        # as long as the client held them
        wait_until(
            lambda: rig.metric("prefill_worker_nixl_silent_connections_closed_total") >= 300,
            30,
            "the silent connections shut down",
        )
        wait_until(lambda: _num_fds(pid) <= before + 5, 10, "their fds back")
        for conn in conns:
            assert conn.recv(1) == b"", "the worker closed its end"
    finally:
        for conn in conns:
            conn.close()
    assert rig.metric("prefill_worker_nixl_silent_connections_closed_total") >= 300
    check_healthy(rig)  # a real decode's push still lands (its UCX connections spoke at once)
