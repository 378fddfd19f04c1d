"""Raw TCP clients on the NIXL/UCX listener (issue #40, finding 7): UCX accepts each
connection and keeps its descriptor until the peer speaks or closes, and lets a closed one go
only as the agent progresses; the worker's push agents were progressed only while writes were
in flight, so every connection a client opened and closed on an idle worker stayed an open
fd for the process's life (300 of 300 here), on to the process limit. Now the idle agent is
progressed every second, the soft fd limit is raised to the hard one at start, and the fds in
use are on /metrics. A client that holds connections open without a word still holds their
fds: NIXL 1.5.1 offers no bound on them (docs/reliability.md)."""

from __future__ import annotations

import os
import resource
import socket

from tests.integration.transfer.test_bootstrap_guard import listening
from tests.polling import wait_until
from tests.reliability.harness import Rig, check_healthy


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
