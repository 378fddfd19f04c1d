"""Deeply nested msgpack from a peer, on a real worker process (issue #24): about 1 KB, an
array nested 1000 deep in a key the protocol ignores. Before: sent once to the bootstrap port,
msgspec's ``RecursionError`` escaped into the engine loop and the worker exited 70; sent once
to the router ingress, it killed the ingress I/O thread (no router got a reply again, while
``/livez`` and ``/readyz`` answered 200). Now each is refused on its bytes, counted, and
answered with its protocol's reject, and the worker serves on.

Each scenario measures what docs/reliability.md reports: the worst router ping round trip
while the attack runs, the worker's RSS peak, and its SIGTERM exit time afterwards."""

from __future__ import annotations

import signal
import threading
import time

import msgspec
import zmq

from prefill_worker.ingress.messages import Reject, RejectCode, Result, encode, prefill_message
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import wire
from tests.checkpoints import prompt
from tests.patience import patient
from tests.reliability.conftest import ProcStats, Rig, check_healthy

DEPTH = 1000
NUM_ATTACKS = 200
MAX_SIGTERM_S = 10.0


def nested(depth: int = DEPTH) -> bytes:
    """``[[[…nil…]]]``, ``depth`` arrays deep: one byte per level."""
    return b"\x91" * depth + b"\xc0"


def with_extra(frame: bytes, value: bytes) -> bytes:
    """``frame`` (a msgpack map of fewer than 15 keys) with one more key, ``"x"``: ``value``."""
    assert 0x80 <= frame[0] < 0x8F
    return bytes([frame[0] + 1]) + frame[1:] + msgspec.msgpack.encode("x") + value


class Watch:
    """Pings the worker's ingress from a router of its own and samples its RSS, until told
    to stop: the worst round trip and the RSS peak during an attack."""

    def __init__(self, rig: Rig) -> None:
        self._router = rig.new_router()
        self._pid = rig.worker.proc.pid
        self._stop = threading.Event()
        self.worst_ping_s = 0.0
        self.peak_rss_kib = ProcStats.of(self._pid).rss_kib
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self._router.ping()
            self.worst_ping_s = max(self.worst_ping_s, time.monotonic() - start)
            self.peak_rss_kib = max(self.peak_rss_kib, ProcStats.of(self._pid).rss_kib)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def rejects(rig: Rig, metric: str, label: str, value: str) -> float:
    return rig.metric(metric, {label: value})


def sigterm_exit_s(rig: Rig) -> float:
    start = time.monotonic()
    rig.worker.proc.send_signal(signal.SIGTERM)
    assert rig.worker.wait_exit(MAX_SIGTERM_S + 5) == 0
    return time.monotonic() - start


def report(edge: str, watch: Watch, rss_before_kib: int, exit_s: float) -> None:
    """The figures docs/reliability.md gives (``pytest -s`` shows them)."""
    rss_mib = (watch.peak_rss_kib - rss_before_kib) / 1024
    print(f"\n{edge}: worst ping {watch.worst_ping_s * 1000:.1f} ms during the attack,", end=" ")
    print(f"RSS peak +{rss_mib:.1f} MiB, SIGTERM exit {exit_s:.2f} s")
    assert exit_s <= MAX_SIGTERM_S


def test_a_nested_message_to_the_bootstrap_port_is_refused(rig_factory) -> None:
    rig = rig_factory()
    pid, rss_before = rig.worker.proc.pid, ProcStats.of(rig.worker.proc.pid).rss_kib
    room = rig.next_room()
    rid = rig.router.send_prefill(prompt(9, seed=24), room)  # waits for its decode's want
    attacker = zmq.Context.instance().socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(rig.worker.bootstrap)
    bad = "prefill_worker_bootstrap_rejects_total"
    before = rejects(rig, bad, "reason", "bad_message")
    frame = with_extra(wire.encode(wire.Heartbeat()), nested())
    assert len(frame) < 1200  # about 1 KB
    watch = Watch(rig)
    try:
        for i in range(NUM_ATTACKS):
            if i == NUM_ATTACKS // 2:
                rig.decode.want(room, 9)  # the legitimate decode, in the middle of the attack
            attacker.send(frame)
            assert attacker.poll(int(patient(5.0) * 1000)), "no reject from the worker"
            reply = wire.decode(attacker.recv())
            assert isinstance(reply, wire.Reject) and "nested deeper" in reply.reason, reply
    finally:
        watch.stop()
        attacker.close()
    assert rejects(rig, bad, "reason", "bad_message") == before + NUM_ATTACKS
    assert rig.router.wait([rid])[rid].status is OutcomeStatus.OK
    assert rig.worker.proc.poll() is None and rig.worker.proc.pid == pid
    check_healthy(rig)  # the next good request is served end to end
    report("bootstrap", watch, rss_before, sigterm_exit_s(rig))


def test_a_nested_message_to_the_router_ingress_is_refused(rig_factory) -> None:
    rig = rig_factory()
    pid, rss_before = rig.worker.proc.pid, ProcStats.of(rig.worker.proc.pid).rss_kib
    before = rejects(rig, "prefill_worker_rejects_total", "code", "malformed")
    room = rig.next_room()
    frame = with_extra(encode(prefill_message("nested", prompt(9, seed=1), room)), nested())
    assert len(frame) < 1200  # about 1 KB
    attacker = rig.new_router()
    watch = Watch(rig)
    try:
        for _ in range(NUM_ATTACKS):
            attacker.send_frame(frame, None)
        attacker.ledger.wait_answered(30)
    finally:
        watch.stop()
    replies = attacker.ledger.replies.get((attacker.conn, None), [])
    assert len(replies) == NUM_ATTACKS
    assert all(isinstance(r, Reject) and r.code is RejectCode.MALFORMED for r in replies), replies[
        :3
    ]
    assert rejects(rig, "prefill_worker_rejects_total", "code", "malformed") == before + NUM_ATTACKS
    attacker.ping()  # the sender is still answered
    room = rig.next_room()
    rig.decode.want(room, 9)
    served = rig.router.prefill(prompt(9, seed=25), room)
    assert isinstance(served, Result) and served.status is OutcomeStatus.OK, served
    assert rig.worker.http("/livez")[0] == 200 and rig.worker.proc.pid == pid
    check_healthy(rig)
    report("ingress", watch, rss_before, sigterm_exit_s(rig))
