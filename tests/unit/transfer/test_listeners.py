"""``nixl.listeners``: silent connections on a listener are shut down after their grace, and
nothing else is: a connection that spoke, one still within its grace, one on another port.
Real sockets of this process, a listener standing in for UCX's (the real one: the reliability
test ``test_ucx_listener.py``); the clock is the test's."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from prefill_worker.transfer.nixl.agent import make_agent
from prefill_worker.transfer.nixl.listeners import SilentConnections, listening_ports, ucx_ports


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Listener:
    """A listening socket of this process and the server side of what connects to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.clients: list[socket.socket] = []
        self.accepted: list[socket.socket] = []

    def connect(self, say: bytes = b"") -> tuple[socket.socket, socket.socket]:
        client = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        server, _ = self.sock.accept()
        server.settimeout(10)
        if say:
            client.sendall(say)
            assert server.recv(len(say)) == say  # received: the kernel has counted it
        self.clients.append(client)
        self.accepted.append(server)
        return client, server

    def close(self) -> None:
        for one in [*self.clients, *self.accepted, self.sock]:
            one.close()


@pytest.fixture
def listeners() -> Iterator[list[_Listener]]:
    made = [_Listener(), _Listener()]
    yield made
    for one in made:
        one.close()


def _is_shut(client: socket.socket) -> bool:
    client.settimeout(10)
    return client.recv(1) == b""


def test_a_silent_connection_is_shut_down_after_its_grace(listeners: list[_Listener]) -> None:
    ucx, _ = listeners
    clock = _Clock()
    silent = SilentConnections(5.0, lambda: {ucx.port}, clock)
    client, server = ucx.connect()
    assert silent.sweep() == 0  # first seen now
    clock.now += 4.9
    assert silent.sweep() == 0  # within its grace
    clock.now += 0.1
    assert silent.sweep() == 1
    assert _is_shut(client)  # the peer reads the end of the stream
    assert server.fileno() != -1  # shut down, not closed: the fd is still its owner's
    assert silent.closed == 1
    assert silent.sweep() == 0  # once


def test_connections_that_spoke_or_are_elsewhere_are_left(listeners: list[_Listener]) -> None:
    ucx, other = listeners
    clock = _Clock()
    silent = SilentConnections(5.0, lambda: {ucx.port}, clock)
    talker, _ = ucx.connect(say=b"\x01")
    elsewhere, _ = other.connect()
    mute, _ = ucx.connect()
    silent.sweep()
    clock.now += 60.0
    assert silent.sweep() == 1  # the mute one only
    assert _is_shut(mute)
    for client in (talker, elsewhere):
        client.settimeout(0.0)
        with pytest.raises(BlockingIOError):  # open, nothing to read
            client.recv(1)
    assert silent.closed == 1


def test_a_connection_is_judged_from_when_a_sweep_first_saw_it(
    listeners: list[_Listener],
) -> None:
    ucx, _ = listeners
    clock = _Clock()
    silent = SilentConnections(5.0, lambda: {ucx.port}, clock)
    first, _ = ucx.connect()
    silent.sweep()
    clock.now += 3.0
    second, _ = ucx.connect()
    silent.sweep()
    clock.now += 2.0
    assert silent.sweep() == 1
    assert _is_shut(first)
    clock.now += 3.0
    assert silent.sweep() == 1
    assert _is_shut(second)


def test_no_ports_no_sweep() -> None:
    assert SilentConnections(0.0, lambda: ()).sweep() == 0


def test_an_agent_records_the_listeners_ucx_opened() -> None:
    before = ucx_ports()
    agent = make_agent("listeners-test", ["UCX"], "lo")
    opened = ucx_ports() - before
    assert opened, "UCX opened no TCP listener for the agent"
    assert opened <= listening_ports()  # listening in this process, while the agent lives
    del agent
