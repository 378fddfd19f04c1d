"""Hostile SGLang peers against the real worker (``transfer.protocol: sglang``) with SGLang's
own decode code as the legitimate decode (issue #24, findings 3 and 4). The attacker is a bare
ZMQ PUSH socket on the worker's control socket, as anyone who can reach it can be:

- ABORT frames naming host names (before: each one's ABORT_ACK made ZMQ's I/O thread resolve
  the name, holding every decode's replies and ``Context.term`` at SIGTERM);
- a registration at the live decode's ``ip:port`` under a new agent name (before: the worker
  dropped the real decode);
- a request naming the live decode's agent from another ``ip:port`` (before: the worker wrote
  the room's KV into that decode's pool, at pages the sender chose);
- a registration whose ip is not its connection's (sent from 127.0.0.2);
- forty registrations with valid NIXL metadata and pools of ``transfer.max_peer_pages`` pages
  that NIXL refuses (before: ~1 s of engine time and ~300 MB each; the decode's ``/health``
  went stale and its room failed).

Each ends with the legitimate decode served and the worker's pid, memory and SIGTERM time
read (printed for docs/reliability.md)."""

from __future__ import annotations

import json
import re
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from prefill_worker.transfer.nixl.agent import make_agent
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Worker
from tests.interop.conftest import Served, launch
from tests.interop.decodes import SglangDecode, new_room
from tests.polling import wait_until
from tests.reliability.watch import Watch, sigterm_exit_s

pytestmark = pytest.mark.interop

NUM_NAMED_ABORTS = 1000
NUM_FLOOD_REGISTRATIONS = 40
REJECTS = re.compile(r'^prefill_worker_bootstrap_rejects_total\{reason="(\w+)"\} (\S+)$', re.M)


@pytest.fixture
def served(checkpoint: Path, tmp_path: Path) -> Iterator[Served]:
    one = launch(tmp_path, checkpoint, 16, "float32", "sglang")
    try:
        yield one.ready()
    finally:
        one.worker.child.kill()


@pytest.fixture
def attacker() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def push(ctx: zmq.Context[zmq.Socket[bytes]], served: Served, source: str = "") -> zmq.Socket:
    """A PUSH socket on the worker's control socket (``source``: the local address to use)."""
    with urllib.request.urlopen(
        f"http://{served.sglang}/route?prefill_dp_rank=0&prefill_cp_rank=0"
        "&target_tp_rank=0&target_pp_rank=0",
        timeout=5,
    ) as response:
        rank = json.loads(response.read())
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{source + ':0;' if source else ''}{rank['rank_ip']}:{rank['rank_port']}")
    return sock


def rejects(worker: Worker, reason: str) -> float:
    _, text = worker.http("/metrics")
    return sum(float(v) for r, v in REJECTS.findall(text) if r == reason)


def registration(
    served: Served, ip: str, port: int, name: str, metadata: bytes, num_slots: int = 0
) -> list[bytes]:
    """A registration as SGLang 0.5.23 sends it: a pool shaped as the worker's, of
    ``num_slots`` pages (0: the decode layout's)."""
    lay = served.layout
    num_slots = num_slots or lay.num_pages
    regions = 2 * lay.num_layers
    u64 = struct.Struct("<Q")
    kv_ptrs = b"".join(u64.pack(4096 * (i + 1)) for i in range(regions))
    aux_ptrs = b"".join(u64.pack(1 << 30 + i) for i in range(10))
    return [
        b"NixlMsgGuard", b"None", ip.encode(), str(port).encode(), name.encode(), metadata,
        kv_ptrs, aux_ptrs, b"", b"0", b"1", b"0", str(lay.page_bytes).encode(), b"", b"",
        b"", b"", str(num_slots).encode(), ",".join(["DRAM"] * regions).encode(),
        b"".join(u64.pack(lay.page_bytes) for _ in range(regions)), b"", b"", b"1", b"0", b"",
    ]  # fmt: skip


def check_served_and_stop(served: Served, decode: SglangDecode, watch: Watch, pid: int) -> None:
    """The decode's next room is served, the pid is the same; then SIGTERM, timed."""
    room = new_room()
    decode.want(room, 40)
    client = BlockingRouterClient(served.worker.ingress)
    try:
        assert client.prefill(prompt(40, seed=room % 1000), room).status is OutcomeStatus.OK
    finally:
        client.close()
    assert decode.wait(room) == ("Success", None)
    watch.stop()
    assert served.worker.proc.pid == pid and served.worker.proc.poll() is None
    exit_s = sigterm_exit_s(served.worker)
    print(f"\n{watch.summary()}; SIGTERM exit {exit_s:.2f} s")


def test_abort_frames_naming_host_names_are_refused_unresolved(
    decode_process: SglangDecodeProcess, served: Served, attacker
) -> None:
    pid = served.worker.proc.pid
    decode = SglangDecode(decode_process, served.sglang, served.layout)
    watch = Watch(served.worker)
    before = rejects(served.worker, "bad_message")
    room = new_room()
    decode.want(room, 40)  # registered, its room waiting for the prefill
    sock = push(attacker, served)
    for i in range(NUM_NAMED_ABORTS):
        sock.send_multipart([b"ABORT", str(i + 1).encode(), f"d{i}.invalid".encode(), b"9", b"1"])
    client = BlockingRouterClient(served.worker.ingress)
    try:
        assert client.prefill(prompt(40, seed=1), room).status is OutcomeStatus.OK
    finally:
        client.close()
    assert decode.wait(room) == ("Success", None)
    goal = before + NUM_NAMED_ABORTS
    wait_until(lambda: rejects(served.worker, "bad_message") >= goal, 30, "the aborts refused")
    check_served_and_stop(served, decode, watch, pid)


def test_a_live_decode_keeps_its_address_and_its_agent(
    decode_process: SglangDecodeProcess, served: Served, attacker
) -> None:
    pid = served.worker.proc.pid
    decode = SglangDecode(decode_process, served.sglang, served.layout)
    watch = Watch(served.worker)
    room = new_room()
    decode.want(room, 40)  # registered, its room waiting for the prefill
    impostor = make_agent("impostor-agent", ["UCX"])
    metadata = impostor.get_agent_metadata()
    sock = push(attacker, served)
    sock.send_multipart(registration(served, decode.ip, decode.port, "impostor-agent", metadata))
    wait_until(lambda: rejects(served.worker, "address_taken") == 1, 10, "address_taken")
    spoofer = push(attacker, served, source="127.0.0.2")
    spoofer.send_multipart(registration(served, "127.0.0.1", 1, "spoofer", metadata))
    wait_until(lambda: rejects(served.worker, "spoofed_address") == 1, 10, "spoofed_address")
    stolen = new_room()  # the attacker names the decode's agent, its own address and pages
    pages = struct.pack("<3i", 1, 2, 3)
    frames = [b"NixlMsgGuard", str(stolen).encode(), b"127.0.0.1", b"9", decode.agent_name.encode()]
    sock.send_multipart([*frames, pages, b"0", b"1", b"", b"0", b"0"])
    wait_until(lambda: rejects(served.worker, "foreign_agent") == 1, 10, "foreign_agent")
    client = BlockingRouterClient(served.worker.ingress)
    try:
        assert client.prefill(prompt(40, seed=2), room).status is OutcomeStatus.OK
        assert client.prefill(prompt(40, seed=3), stolen).status is OutcomeStatus.FAILED
    finally:
        client.close()
    assert decode.wait(room) == ("Success", None)
    assert "sglang: dropping decode" not in served.worker.log()
    check_served_and_stop(served, decode, watch, pid)


def test_registrations_at_the_page_limit_leave_the_decode_its_room(
    decode_process: SglangDecodeProcess, served: Served, attacker
) -> None:
    pid = served.worker.proc.pid
    decode = SglangDecode(decode_process, served.sglang, served.layout)
    agents = [make_agent(f"flood-{i}", ["UCX"]) for i in range(NUM_FLOOD_REGISTRATIONS)]
    watch = Watch(served.worker)
    room = new_room()
    decode.want(room, 40)  # registered, its room waiting for the prefill
    sock = push(attacker, served)
    for i, agent in enumerate(agents):
        metadata = agent.get_agent_metadata()
        big = registration(served, "127.0.0.1", 20000 + i, f"flood-{i}", metadata, 2**20)
        sock.send_multipart(big)
    client = BlockingRouterClient(served.worker.ingress)
    try:
        assert client.prefill(prompt(40, seed=4), room).status is OutcomeStatus.OK
    finally:
        client.close()
    assert decode.wait(room) == ("Success", None)
    goal = NUM_FLOOD_REGISTRATIONS
    wait_until(lambda: rejects(served.worker, "nixl_refused") >= goal, 60, "refusals")
    check_served_and_stop(served, decode, watch, pid)
