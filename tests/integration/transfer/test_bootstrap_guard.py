"""The bootstrap server under hostile or unlucky peers, real NIXL (issue #12): every message is
judged before work is done for it, a peer is the connection that registered it, a room is
bound once and only to the peer the router named, and the decode SDK recovers by itself.

Each test ends with the worker serving a real decode and ``check_whole`` (no sender open, no
write in flight, every page and aux row back)."""

from __future__ import annotations

import dataclasses
import ipaddress
import signal
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.auth

from prefill_worker.curve import CurveClientKeys, CurveServerKeys
from prefill_worker.kv.aux import AuxRow
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.agent import deregister_regions, make_agent, register_regions
from tests.integration.transfer.conftest import PEER_TIMEOUT_S, Worker, small_spec
from tests.integration.transfer.peers import PoolSpec, regions_over
from tests.integration.transfer.test_nixl_transfer import expected_pool
from tests.polling import wait_until

FAST_S = 0.5  # a refusal comes this fast: no work was done for the message
_NAMES = iter(range(10**6))


class RawPeer:
    """A hand-driven decode peer in this process: a real NIXL agent over a real pool, a bare
    DEALER, and messages the test composes (or mangles)."""

    def __init__(
        self,
        worker: Worker,
        name: str | None = None,
        routing_id: bytes | None = None,
        spec: PoolSpec | None = None,
    ) -> None:
        self.worker = worker
        self.name = name or f"raw-{next(_NAMES)}"
        spec = spec or worker.spec
        self.agent = make_agent(self.name, ["UCX"])
        self.pool = np.zeros(spec.nbytes, np.uint8)
        self.regions = regions_over(spec, self.pool)
        self._reg = register_regions(self.agent, self.regions)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.connect(worker.backend.bootstrap_endpoint)

    def register_msg(self, **region_changes: object) -> wire.Register:
        regions = dataclasses.replace(self.regions, **region_changes)  # type: ignore[arg-type]
        metadata = wire.frame_metadata(self.agent.get_agent_metadata())
        return wire.Register.of(self.name, metadata, regions, self.regions.layout.compat_hash())

    def send(self, msg: wire.Message) -> None:
        self.sock.send(wire.encode(msg))

    def reply(self, timeout_s: float = 5.0) -> wire.Message:
        """The next message from the worker (heartbeats skipped), driving the worker."""
        while True:
            assert self.worker.drive(lambda: bool(self.sock.poll(0)), timeout_s), "no reply"
            msg = wire.decode(self.sock.recv())
            if not isinstance(msg, wire.Heartbeat):
                return msg

    def ask(self, msg: wire.Message, timeout_s: float = 5.0) -> wire.Message:
        self.send(msg)
        return self.reply(timeout_s)

    def register(self) -> None:
        reply = self.ask(self.register_msg())
        assert isinstance(reply, wire.Registered) and reply.is_ok, reply

    def close(self) -> None:
        self.sock.close(linger=0)
        deregister_regions(self.agent, self._reg)


@pytest.fixture
def raw_peers(workers):
    made: list[RawPeer] = []

    def make(worker: Worker | None = None, **kwargs) -> RawPeer:
        made.append(RawPeer(worker or workers["bfloat16"], **kwargs))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def serve(worker: Worker, decode, room: int, num_tokens: int = 32, **create) -> None:
    """One request end to end to ``decode`` (a child ``Decode``): the right bytes, then DONE."""
    lay = worker.spec.layout
    num_pages = -(-num_tokens // lay.page_size)
    dst = list(range(lay.num_pages - num_pages, lay.num_pages))
    assert decode.call("want", room, dst, 1, 0) == "ok"
    sender = worker.backend.create_sender(room, f"req-{room}", num_tokens, **create)
    assert worker.drive(lambda: sender.poll() is KVPoll.READY), sender.failure_reason()
    finish(worker, decode, sender, room, dst)


def finish(worker: Worker, decode, sender, room: int, dst: list[int]) -> None:
    """Push a READY sender's pages and aux row; the decode pool holds exactly those bytes."""
    before = decode.pool.copy()
    pages = worker.alloc(len(dst))
    sender.send_pages(pages, 0)
    row = worker.finish(sender, AuxRow(room % 1000, -1.0, 4 * len(dst), 0))
    assert decode.call("wait", room, 5.0) == ("done", None)
    lay = worker.spec.layout
    kv_bytes = lay.pool_bytes
    want = expected_pool(worker, before, list(zip(pages, dst, strict=True)))
    assert np.array_equal(decode.pool[:kv_bytes], want[:kv_bytes])
    sender.close()
    worker.pages.free(pages)
    worker.aux.free(row)


def counts(worker: Worker) -> dict[str, int]:
    return dict(worker.backend.reject_counts)


# ── 1. crashes: a register is judged before any work ─────────────────────────────────────────


def num_pages(count: int):
    return lambda regions: {"layout": dataclasses.replace(regions.layout, num_pages=count)}


def negative_base(regions):  # type: ignore[no-untyped-def]
    """Every address moved so that the first region starts at -4096 (the layout kept)."""
    shift = regions.k_base_addrs[0] + 4096
    return {
        "k_base_addrs": tuple(a - shift for a in regions.k_base_addrs),
        "v_base_addrs": tuple(a - shift for a in regions.v_base_addrs),
    }


@pytest.mark.parametrize(
    ("change", "reason", "words"),
    [
        (num_pages(2**40), "too_large", "1099511627776 pages"),
        (num_pages(2**22), "too_large", "4194304 pages"),
        (negative_base, "bad_address", "region 0 [-4096"),
        (lambda _: {"device": "cuda:x"}, "bad_device", "'cuda:x'"),
    ],
    ids=["2**40 pages", "2**22 pages", "negative address", "cuda:x"],
)
def test_a_register_that_crashed_the_engine_is_refused_fast(
    workers, decodes, raw_peers, change, reason, words
) -> None:
    worker = workers["bfloat16"]
    peer = raw_peers()
    changes = change(peer.regions)
    before = counts(worker).get(reason, 0)
    start = time.monotonic()
    reply = peer.ask(peer.register_msg(**changes))
    assert time.monotonic() - start < FAST_S
    assert isinstance(reply, wire.Registered) and not reply.is_ok
    assert words in (reply.reason or "")
    assert counts(worker)[reason] == before + 1
    assert not worker.backend.has_peer(peer.name)
    serve(worker, decodes(worker), 201)
    worker.check_whole()


# ── 2. denial of service: the peer and the size come before the page list ────────────────────


def test_a_big_want_from_an_unregistered_peer_costs_nothing(workers, decodes, raw_peers) -> None:
    worker = workers["bfloat16"]
    stranger = raw_peers()
    ids = b"\x01\x00\x00\x00" * 900_000  # 3.6 MB of page ids, under the 4 MiB message limit
    start = time.monotonic()
    reply = stranger.ask(wire.Want(202, ids, 0, 0))
    assert time.monotonic() - start < FAST_S
    assert reply == wire.Status(202, "failed", "decode peer not registered", "unknown_peer")
    stranger.send(wire.Want(203, ids * 5, 0, 0))  # 18 MB: ZMQ drops it and the connection
    decode = decodes(worker)
    serve(worker, decode, 204)
    assert not stranger.sock.poll(0), "the oversized want got an answer"
    registered = raw_peers()
    registered.register()
    reply = registered.ask(wire.Want(205, ids, 0, 0))
    assert isinstance(reply, wire.Status) and reply.code == "bad_want"
    assert reply.reason == "want names 900000 pages; at most 24 can be needed"
    worker.check_whole()


# ── 3. identity: owners, names, rooms ────────────────────────────────────────────────────────


def test_only_the_named_decode_may_claim_a_room(workers, decodes, raw_peers) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    assert decode.call("registered", 10.0) is None
    name = decode.call("name")
    thief = raw_peers()
    thief.register()
    thief.send(wire.Want.of(206, range(8), 0, 0))  # first, before the request
    assert worker.drive(lambda: worker.backend.num_claims(206) == 1)
    sender = worker.backend.create_sender(206, "req-206", 32, allowed_peer=name)
    reply = thief.reply()
    assert isinstance(reply, wire.Status) and reply.code == "foreign_room"
    assert "reserved by the router for another decode peer" in (reply.reason or "")
    assert sender.poll() is KVPoll.BOOTSTRAPPING
    assert decode.call("want", 206, list(range(16, 24)), 1, 0) == "ok"
    assert worker.drive(lambda: sender.poll() is KVPoll.READY)
    reply = thief.ask(wire.Want.of(206, range(8), 0, 0))  # and after: still not theirs
    assert isinstance(reply, wire.Status) and reply.code == "foreign_room"
    finish(worker, decode, sender, 206, list(range(16, 24)))
    assert not thief.pool.any(), "the thief got bytes"
    assert counts(worker)["foreign_room"] >= 2
    worker.check_whole()


def test_without_a_named_decode_the_first_want_binds_once(workers, raw_peers) -> None:
    worker = workers["bfloat16"]
    first, second = raw_peers(), raw_peers()
    first.register()
    second.register()
    first.send(wire.Want.of(207, range(8), 0, 0))
    assert worker.drive(lambda: worker.backend.num_claims(207) == 1)
    second.send(wire.Want.of(207, range(8), 0, 0))  # waits, then loses to the first
    assert worker.drive(lambda: worker.backend.num_claims(207) == 2)
    sender = worker.backend.create_sender(207, "req-207", 32)
    reply = second.reply()
    assert reply == wire.Status(207, "failed", "duplicate want for 207", "duplicate_want")
    assert sender.poll() is KVPoll.READY
    reply = second.ask(wire.Want.of(207, range(8), 0, 0))
    assert isinstance(reply, wire.Status) and reply.code == "duplicate_want"
    sender.close()
    assert first.reply() == wire.Status(207, "failed", "the request ended before its transfer")
    worker.check_whole()


def test_a_second_request_on_a_room_in_use_fails_alone(workers, decodes) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    assert decode.call("registered", 10.0) is None
    dst = list(range(8, 16))
    assert decode.call("want", 208, dst, 2, 0) == "ok"
    first = worker.backend.create_sender(208, "req-a", 32)
    assert worker.drive(lambda: first.poll() is KVPoll.READY)
    second = worker.backend.create_sender(208, "req-b", 13)
    assert second.poll() is KVPoll.FAILED
    assert "bootstrap_room is already in use" in (second.failure_reason() or "")
    second.close()
    assert first.poll() is KVPoll.READY
    finish(worker, decode, first, 208, dst)  # the first request's KV, exactly, and DONE
    worker.check_whole()


def test_abort_and_bye_count_only_from_the_owner(workers, decodes, raw_peers) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    assert decode.call("registered", 10.0) is None
    assert decode.call("want", 209, list(range(8)), 0, 0) == "ok"
    assert decode.call("want", 210, list(range(8, 16)), 1, 0) == "ok"
    bound = worker.backend.create_sender(209, "req-209", 32)
    assert worker.drive(lambda: bound.poll() is KVPoll.READY)
    other, stranger = raw_peers(), raw_peers()
    other.register()
    for peer in (other, stranger):
        for room in (209, 210):  # a bound room, and a room still waiting for its request
            assert peer.ask(wire.Abort(room)) == wire.Status(room, "aborted", "aborted by decode")
    stranger.send(wire.Bye())
    other.send(wire.Bye())  # its own bye: only itself leaves
    assert worker.drive(lambda: not worker.backend.has_peer(other.name))
    assert bound.poll() is KVPoll.READY
    waiting = worker.backend.create_sender(210, "req-210", 32)
    assert worker.drive(lambda: waiting.poll() is KVPoll.READY)
    finish(worker, decode, bound, 209, list(range(8)))
    finish(worker, decode, waiting, 210, list(range(8, 16)))
    worker.check_whole()


def test_a_taken_agent_name_cannot_be_registered_again(workers, decodes, raw_peers) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    assert decode.call("registered", 10.0) is None
    name = decode.call("name")
    before = counts(worker)
    impostor = raw_peers(name=name)  # a real agent under the victim's name: valid metadata
    msg = impostor.register_msg()
    corrupt = msgspec.structs.replace(msg, metadata=msg.metadata[:-3])
    reply = impostor.ask(corrupt)
    assert isinstance(reply, wire.Registered) and "length mismatch" in (reply.reason or "")
    reply = impostor.ask(msg)
    assert isinstance(reply, wire.Registered) and not reply.is_ok
    assert reply.reason == f"agent name {name!r} is registered by another live connection"
    after = counts(worker)
    assert after["bad_metadata"] == before.get("bad_metadata", 0) + 1
    assert after["name_taken"] == before.get("name_taken", 0) + 1
    serve(worker, decode, 211)  # the victim was never touched
    worker.check_whole()


def test_a_name_whose_connection_closed_can_be_registered_again(workers, raw_peers) -> None:
    """A decode that reconnects (new connection, same agent) replaces its old registration
    once the worker sees the old connection gone; until then it is told the name is taken."""
    worker = workers["bfloat16"]
    peer = raw_peers()
    peer.register()
    old = worker.backend.num_peers
    peer.sock.close(linger=0)
    peer.sock = zmq.Context.instance().socket(zmq.DEALER)
    peer.sock.setsockopt(zmq.LINGER, 0)
    peer.sock.connect(worker.backend.bootstrap_endpoint)
    replies: list[wire.Message] = []

    def registered() -> bool:
        replies.append(peer.ask(peer.register_msg()))
        return isinstance(replies[-1], wire.Registered) and replies[-1].is_ok

    wait_until(registered, 5.0, "the new connection to register")
    assert all("another live connection" in (r.reason or "") for r in replies[:-1])
    assert worker.backend.num_peers == old and worker.backend.has_peer(peer.name)
    worker.backend.check_integrity()


def test_a_multi_frame_message_is_rejected_and_counted(workers, raw_peers) -> None:
    worker = workers["bfloat16"]
    peer = raw_peers()
    before = counts(worker).get("bad_message", 0)
    peer.sock.send_multipart([wire.encode(wire.Heartbeat()), b"x", b"y"])
    assert peer.reply() == wire.Reject("a message is one frame, this one has 3")
    assert counts(worker)["bad_message"] == before + 1


# ── 6. recovery ──────────────────────────────────────────────────────────────────────────────


def test_a_dropped_decode_registers_again_by_itself(workers, decodes) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker, timeout_s=30.0)  # the decode side never gives up on the worker
    assert decode.call("registered", 10.0) is None
    decode.signal(signal.SIGSTOP)
    try:
        assert worker.drive(lambda: worker.backend.num_peers == 0, PEER_TIMEOUT_S + 2.0)
    finally:
        decode.signal(signal.SIGCONT)
    serve(worker, decode, 212)  # the want is refused as unknown, re-registered, sent again
    assert worker.backend.has_peer(decode.call("name"))
    worker.check_whole()


def test_a_pending_room_times_out_in_the_sdk(workers, decodes) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker, options={"room_timeout_s": 0.3})
    assert decode.call("registered", 10.0) is None
    assert decode.call("want", 213, list(range(8)), 0, 0) == "ok"
    # The reason names the SDK's room timeout; the wait is long only for a slow machine.
    assert decode.call("wait", 213, 30.0, timeout_s=40.0) == (
        "failed",
        "room 213 still pending after 0.3 s",
    )
    assert worker.drive(lambda: worker.backend.num_claims(213) == 0, 10.0)
    worker.check_whole()


# ── 4. CurveZMQ ──────────────────────────────────────────────────────────────────────────────


def test_curve_lets_only_an_allow_listed_decode_register(
    decodes, tmp_path: Path, pool_layout: str
) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "worker")
    decode_public, decode_secret = zmq.auth.create_certificates(str(keys), "decode")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    (allowed / "decode.key").write_bytes(Path(decode_public).read_bytes())
    worker = Worker(
        small_spec("bfloat16", pool_layout),
        curve=CurveServerKeys.from_files(server_secret, str(allowed)),
    )
    try:
        good = CurveClientKeys.from_files(decode_secret, server_public)
        bad = CurveClientKeys.from_files(stranger_secret, server_public)
        stranger = decodes(worker, options={"curve": bad})
        plain = decodes(worker)
        decode = decodes(worker, options={"curve": good})
        assert decode.call("registered", 10.0) is None
        serve(worker, decode, 214)
        for refused in (stranger, plain):  # no answer at all: "silent" or "no answer"
            assert refused.call("registered", 0.5) is not None
            assert not worker.backend.has_peer(refused.call("name"))
        assert worker.backend.num_peers == 1
        worker.check_whole()
    finally:
        worker.backend.close()


# ── 5. the UCX listener ──────────────────────────────────────────────────────────────────────


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, IPv4 and IPv6 (/proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                addr, port = fields[1].split(":")
                out.add((_address(bytes.fromhex(addr)), int(port, 16)))
    return out


def _address(raw: bytes) -> str:
    """/proc/net/tcp{,6} print addresses as host-order 32-bit words."""
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    return str(ipaddress.ip_address(b"".join(words)))


def test_ucx_listens_on_loopback_only_when_told(decodes, pool_layout: str) -> None:
    from tests.integration.transfer.conftest import CTX
    from tests.integration.transfer.peers import prefill_main

    spec = small_spec("bfloat16", pool_layout)
    found = {}
    for devices in ("lo", None):
        conn, child = CTX.Pipe()
        args = (child, spec, PEER_TIMEOUT_S, devices)
        proc = CTX.Process(target=prefill_main, args=args, daemon=True)
        proc.start()
        try:
            assert conn.poll(30)
            conn.recv()
            assert proc.pid is not None
            found[devices] = listening(proc.pid)
        finally:
            proc.kill()
            proc.join(5)
    assert found["lo"] and all(ip == "127.0.0.1" for ip, _ in found["lo"]), found["lo"]
    assert not {ip for ip, _ in found[None]} & {"0.0.0.0", "::"}, found[None]
    # And a loopback-only worker still pushes KV to a decode with UCX's default devices.
    worker = Worker(spec, ucx_net_devices="lo")
    try:
        serve(worker, decodes(worker), 215)
        worker.check_whole()
    finally:
        worker.backend.close()


# ── 1. the safety net ────────────────────────────────────────────────────────────────────────


def test_a_message_that_raises_anyway_never_leaves_poll(decodes, pool_layout: str) -> None:
    """Whatever a message makes raise (here the reject counter itself, once) refuses its
    sender, is counted as internal_error, and the worker serves on."""
    seen: list[str] = []

    def flaky_counter(reason: str) -> None:
        seen.append(reason)
        if len(seen) == 1:
            raise RuntimeError("counter broke")

    worker = Worker(small_spec("bfloat16", pool_layout), on_reject=flaky_counter)
    stranger = RawPeer(worker)
    try:
        reply = stranger.ask(wire.Want.of(216, range(8), 0, 0))
        assert reply == wire.Reject(
            "internal error on a bootstrap message: RuntimeError('counter broke')"
        )
        assert seen == ["unknown_peer", "internal_error"]
        assert counts(worker)["internal_error"] == 1
        serve(worker, decodes(worker), 217)
        worker.check_whole()
    finally:
        stranger.close()
        worker.backend.close()


def test_a_decode_abort_that_overtakes_its_request_ends_it_at_once(workers, decodes) -> None:
    """The abort comes over the bootstrap socket while the prefill is still on its way through
    the router: the request ends ``aborted`` when it arrives, not at its bootstrap timeout."""
    worker = workers["bfloat16"]
    decode = decodes(worker)
    assert decode.call("registered", 10.0) is None
    assert decode.call("want", 230, list(range(8)), 0, 0) == "ok"
    assert worker.drive(lambda: worker.backend.num_claims(230) == 1)
    assert decode.call("abort", 230) == "ok"
    assert worker.drive(lambda: worker.backend.num_claims(230) == 0)
    sender = worker.backend.create_sender(230, "req-230", 32)
    assert sender.poll() is KVPoll.ABORTED
    sender.close()
    unrelated = worker.backend.create_sender(231, "req-231", 32)  # no abort: it waits
    assert unrelated.poll() is KVPoll.BOOTSTRAPPING
    unrelated.close()
    serve(worker, decode, 232)
    worker.check_whole()
