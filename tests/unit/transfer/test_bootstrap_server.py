"""The bootstrap socket on its own (ZMQ, no NIXL): a multi-frame message is answered, a second
connection cannot take over a routing id in use, and CURVE admits only allow-listed keys."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from prefill_worker.curve import CurveClientKeys, CurveServerKeys, apply_client
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.native.bootstrap import MAX_REGISTERS_PER_TURN, BootstrapServer
from tests.polling import wait_until


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def dealer(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    routing_id: bytes | None = None,
    curve: CurveClientKeys | None = None,
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if curve is not None:
        apply_client(sock, curve)
    sock.connect(endpoint)
    return sock


def receive(server: BootstrapServer, count: int) -> list[tuple[bytes, object]]:
    got: list[tuple[bytes, object]] = []
    wait_until(lambda: bool(got.extend(server.poll()) or len(got) >= count), 5.0, "messages")
    return got


def collect_for(server: BootstrapServer, window_s: float) -> list[tuple[bytes, object]]:
    """Everything that arrives within the window: a bound on watching for what must not come."""
    got: list[tuple[bytes, object]] = []
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        got.extend(server.poll())
        time.sleep(0.005)
    return got


def test_a_multi_frame_message_becomes_an_error_for_its_sender(ctx) -> None:
    server = BootstrapServer("tcp://127.0.0.1:0")
    try:
        sock = dealer(ctx, server.endpoint)
        sock.send_multipart([wire.encode(wire.Heartbeat()), b"extra"])
        [(identity, msg)] = receive(server, 1)
        assert isinstance(msg, wire.WireError) and "this one has 2" in str(msg)
        assert server.send(identity, wire.Reject(str(msg)))
        assert sock.poll(5000)
        assert wire.decode(sock.recv()) == wire.Reject("a message is one frame, this one has 2")
    finally:
        server.close()


def test_a_second_connection_cannot_take_over_a_routing_id(ctx) -> None:
    server = BootstrapServer("tcp://127.0.0.1:0")
    try:
        first = dealer(ctx, server.endpoint, b"victim")
        first.send(wire.encode(wire.Heartbeat()))
        [(identity, _)] = receive(server, 1)
        assert identity == b"victim"
        impostor = dealer(ctx, server.endpoint, b"victim")
        impostor.send(wire.encode(wire.Bye()))
        witness = dealer(ctx, server.endpoint)  # sent after the impostor's bye, same server
        witness.send(wire.encode(wire.Heartbeat()))
        got = receive(server, 1) + collect_for(server, 0.3)
        assert [type(m) for _, m in got] == [wire.Heartbeat], "the impostor's bye arrived"
        first.send(wire.encode(wire.Abort(1)))
        assert receive(server, 1) == [(b"victim", wire.Abort(1))]
        assert server.send(b"victim", wire.Heartbeat()) and first.poll(5000)
        assert impostor.poll(100) == 0
    finally:
        server.close()


def test_curve_admits_only_allow_listed_keys(ctx, tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "decode")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    (allowed / "decode.key").write_bytes(Path(client_public).read_bytes())
    server = BootstrapServer(
        "tcp://127.0.0.1:0", curve=CurveServerKeys.from_files(server_secret, str(allowed))
    )
    try:
        stranger = dealer(
            ctx, server.endpoint, curve=CurveClientKeys.from_files(stranger_secret, server_public)
        )
        plain = dealer(ctx, server.endpoint)
        good = dealer(
            ctx, server.endpoint, curve=CurveClientKeys.from_files(client_secret, server_public)
        )
        stranger.send(wire.encode(wire.Abort(1)))
        plain.send(wire.encode(wire.Abort(2)))
        good.send(wire.encode(wire.Abort(3)))
        got = receive(server, 1) + collect_for(server, 0.3)
        assert [m for _, m in got] == [wire.Abort(3)]
    finally:
        server.close()


def test_one_turn_reads_a_bounded_number_of_registers(ctx) -> None:
    """The rest wait in the socket: the engine's turn stays short, its next one sees them."""
    server = BootstrapServer("tcp://127.0.0.1:0")
    try:
        sock = dealer(ctx, server.endpoint)
        regions = KVRegions(KVLayout(1, 1, 4, "float32", 4, 8), (4096,), (8192,), "cpu", 1 << 20, 4)
        register = wire.encode(wire.Register.of("flood", wire.frame_metadata(b"md"), regions, "h"))
        for _ in range(2 * MAX_REGISTERS_PER_TURN + 1):
            sock.send(register)
        sock.send(wire.encode(wire.Heartbeat()))
        turns: list[list[type]] = []

        def turn() -> bool:
            got = server.poll()
            if got:
                turns.append([type(m) for _, m in got])
            return sum(map(len, turns)) >= 2 * MAX_REGISTERS_PER_TURN + 2

        wait_until(turn, 5.0, "every message")
        assert all(t.count(wire.Register) <= MAX_REGISTERS_PER_TURN for t in turns), turns
        assert len(turns) >= 3 and turns[-1][-1] is wire.Heartbeat
    finally:
        server.close()
