"""Peers that speak ZMTP/1.0 (issue #40, finding 1): a raw TCP client that sends the old
greeting (``01 00``) and one short frame reaches a ZMQ socket as a message whose connection has
no metadata; libzmq then answers EINVAL for ``SRCFD`` and ``Peer-Address``. Those bytes stopped
the router ingress's I/O thread (and the SGLang control socket's the same way): no router got
an answer again while the process stayed up. Each socket that reads a message's connection
properties now drops such a message, counts it, and keeps serving."""

from __future__ import annotations

import socket

from prefill_worker.testing.launch import free_port
from tests.patience import patient
from tests.polling import wait_until
from tests.reliability.harness import Rig, check_healthy, serve_fresh

# The greeting of ZMTP/1.0 (an empty identity frame: length 1, flags 0), then one frame of
# length 8 (flags 0 and seven bytes): eleven bytes, no signature, no metadata.
ZMTP_1_0 = b"\x01\x00" + b"\x08\x00hostile"
MALFORMED = "prefill_worker_malformed_messages_total"
BAD_MESSAGE = ("prefill_worker_bootstrap_rejects_total", {"reason": "bad_message"})


def _send_raw(endpoint: str, data: bytes) -> socket.socket:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=patient(10))
    conn.sendall(data)
    return conn  # left open: the peer stays connected while the worker reads its frames


def test_zmtp_1_0_bytes_on_the_ingress_are_dropped_and_counted(rig: Rig) -> None:
    before = rig.metric(MALFORMED)
    conns = [_send_raw(rig.worker.ingress, ZMTP_1_0) for _ in range(3)]
    try:
        wait_until(lambda: rig.metric(MALFORMED) >= before + 3, 30, "three messages counted")
        status, text = rig.worker.http("/livez")
        assert status == 200, text
        serve_fresh(rig)  # the ingress thread is alive and answering
    finally:
        for conn in conns:
            conn.close()
    check_healthy(rig)


def test_zmtp_1_0_bytes_on_the_sglang_control_socket_are_dropped_and_counted(
    rig_factory,
) -> None:
    control_port = free_port()
    rig: Rig = rig_factory(
        "transfer.protocol=both",
        f"transfer.sglang_bootstrap_bind=127.0.0.1:{free_port()}",
        f"transfer.sglang_rank_port={control_port}",
    )
    before = rig.metric(*BAD_MESSAGE)
    conn = _send_raw(f"127.0.0.1:{control_port}", ZMTP_1_0)
    try:
        wait_until(lambda: rig.metric(*BAD_MESSAGE) >= before + 1, 30, "the message counted")
        status, text = rig.worker.http("/livez")
        assert status == 200, text  # the control socket's thread still runs
    finally:
        conn.close()
    check_healthy(rig)
