"""Bootstrap scenarios on a real worker process (issue #12, decode side): registers that used to
crash the engine, oversized and foreign wants, rooms claimed by the wrong peer, a second request
on a room in use, impostors under a taken name, non-owners' abort and bye, a multi-frame message,
a dropped decode that comes back by itself, and UCX listening on loopback only.

Hostile peers are hand-driven: a bare DEALER and, where the metadata must be valid, a real NIXL
agent over a real pool in this process. Every scenario ends with ``check_healthy``."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.auth

from prefill_worker.curve import CurveClientKeys
from prefill_worker.ingress.messages import Result, encode, prefill_message
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import KVReceiver, RegistrationError, RoomState, wire
from prefill_worker.transfer.nixl.agent import deregister_regions, make_agent, register_regions
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PAGE_SIZE
from tests.integration.transfer.test_bootstrap_guard import listening
from tests.polling import wait_until
from tests.reliability.conftest import LiveDecode, Rig, check_healthy

FAST_S = 1.0  # a refusal's round trip through a live worker: no work was done for it
LAYOUT = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float32", PAGE_SIZE, 64)
REJECTS = "prefill_worker_bootstrap_rejects_total"
_NAMES = iter(range(10**6))


class RawPeer:
    """A hand-driven bootstrap client: a bare DEALER, and a real NIXL agent over a real pool so
    that its ``register`` carries valid metadata."""

    def __init__(self, endpoint: str, name: str | None = None) -> None:
        self.name = name or f"raw-{next(_NAMES)}"
        self.agent = make_agent(self.name, ["UCX"])
        self.pool = np.zeros(2 * NUM_LAYERS * LAYOUT.region_bytes, np.uint8)
        self.aux = AuxPool(8)
        base, size = int(self.pool.ctypes.data), LAYOUT.region_bytes
        starts = tuple(base + i * size for i in range(2 * NUM_LAYERS))
        self.regions = KVRegions(
            LAYOUT, starts[:NUM_LAYERS], starts[NUM_LAYERS:], "cpu", self.aux.base_addr, 8
        )
        self._reg = register_regions(self.agent, self.regions)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def register_msg(self, **region_changes: object) -> wire.Register:
        regions = dataclasses.replace(self.regions, **region_changes)  # type: ignore[arg-type]
        metadata = wire.frame_metadata(self.agent.get_agent_metadata())
        return wire.Register.of(self.name, metadata, regions, LAYOUT.compat_hash())

    def send(self, msg: wire.Message) -> None:
        self.sock.send(wire.encode(msg))

    def reply(self, timeout_s: float = 5.0) -> wire.Message:
        """The next message other than a heartbeat."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int(1000 * (deadline - time.monotonic()))
            assert left_ms > 0 and self.sock.poll(left_ms), "no reply from the worker"
            msg = wire.decode(self.sock.recv())
            if not isinstance(msg, wire.Heartbeat):
                return msg

    def ask(self, msg: wire.Message) -> tuple[wire.Message, float]:
        start = time.monotonic()
        self.send(msg)
        return self.reply(), time.monotonic() - start

    def close(self) -> None:
        self.sock.close(linger=0)
        deregister_regions(self.agent, self._reg)


@pytest.fixture
def raw(rig: Rig):
    made: list[RawPeer] = []

    def make(name: str | None = None) -> RawPeer:
        made.append(RawPeer(rig.worker.bootstrap, name))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def rejects(rig: Rig, reason: str) -> float:
    return rig.metric(REJECTS, {"reason": reason})


def prefill(rig: Rig, room: int, num_tokens: int, seed: int, decode_peer: str | None = None):
    """Send a prefill (optionally naming the decode peer); returns its request id."""
    rid = f"boot-{room}-{seed}"
    msg = prefill_message(rid, prompt(num_tokens, seed=seed), room, decode_peer=decode_peer)
    rig.router.send_frame(encode(msg), rid)
    return rid


# ── crashes ──────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("changes", "reason", "words"),
    [
        ({"layout": dataclasses.replace(LAYOUT, num_pages=2**40)}, "too_large", "1099511627776"),
        ({"layout": dataclasses.replace(LAYOUT, num_pages=2**22)}, "too_large", "4194304"),
        ({"k_base_addrs": (-4096, 4096)}, "bad_address", "region 0 [-4096"),
        ({"device": "cuda:x"}, "bad_device", "'cuda:x'"),
    ],
    ids=["2**40 pages", "2**22 pages", "negative address", "cuda:x"],
)
def test_a_register_that_crashed_the_worker_is_refused(rig: Rig, raw, changes, reason, words):
    peer = raw()
    before = rejects(rig, reason)
    reply, took_s = peer.ask(peer.register_msg(**changes))
    assert isinstance(reply, wire.Registered) and not reply.is_ok
    assert words in (reply.reason or "") and took_s < FAST_S
    assert rejects(rig, reason) == before + 1
    check_healthy(rig)


# ── denial of service ────────────────────────────────────────────────────────────────────────


def test_big_wants_from_an_unregistered_peer_cost_nothing(rig: Rig, raw) -> None:
    stranger = raw()
    ids = b"\x07\x00\x00\x00" * 1_000_000  # 4 MB of page ids
    for _ in range(8):  # 16 MiB each: ZMQ drops them (and the connection) before we see them
        stranger.send(wire.Want(1, ids * 4, 0, 0))
    check_healthy(rig)
    stranger = raw()
    reply, took_s = stranger.ask(wire.Want(2, ids[: 900_000 * 4], 0, 0))
    assert reply == wire.Status(2, "failed", "decode peer not registered", "unknown_peer")
    assert took_s < FAST_S
    registered = raw()
    reply, _ = registered.ask(registered.register_msg())
    assert isinstance(reply, wire.Registered) and reply.is_ok, reply
    reply, took_s = registered.ask(wire.Want(3, ids[: 900_000 * 4], 0, 0))
    assert isinstance(reply, wire.Status) and reply.code == "bad_want", reply
    assert reply.reason == "want names 900000 pages; at most 64 can be needed" and took_s < FAST_S
    check_healthy(rig)


# ── rooms ────────────────────────────────────────────────────────────────────────────────────


def test_a_room_named_for_a_decode_goes_only_to_it(rig_factory) -> None:  # type: ignore[no-untyped-def]
    # the thief's want must still wait when the prefill comes: tiny-test's 5 s passed first
    # once at load (its room failed 'prefill request never arrived', the path not taken)
    rig = rig_factory("scheduler.bootstrap_timeout_s=120")
    thief = LiveDecode(rig.worker.bootstrap)
    try:
        room = rig.next_room()
        thief.want(room, 9)  # the thief wants the room first
        rig.decode.want(room, 9)
        rid = prefill(rig, room, 9, seed=5, decode_peer=rig.decode.receiver.agent_name)
        reply = rig.router.wait([rid])[rid]
        assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
        assert rig.decode.wait([room])[room].state is RoomState.DONE
        stolen = thief.wait([room])[room]
        assert stolen.state is RoomState.FAILED
        assert "reserved by the router for another decode peer" in (stolen.reason or "")
        assert all(not k.any() for k in thief.k), "the thief got KV"
        rig.decode.release(room)
        thief.release(room)
    finally:
        thief.close()
    check_healthy(rig)


def test_without_a_named_decode_the_first_want_wins_and_only_it(rig: Rig) -> None:
    """First come, first served when the router names no decode: the other gets a refusal,
    never someone else's bytes, and the router learns which one got it only through the
    decode. Name the decode (``decode_peer``) to make a room a capability."""
    other = LiveDecode(rig.worker.bootstrap)
    try:
        room = rig.next_room()
        other.want(room, 9)
        rig.decode.want(room, 9)  # both before the request: one binds, the other is refused
        rid = prefill(rig, room, 9, seed=6)
        assert rig.router.wait([rid])[rid].status is OutcomeStatus.OK
        got = [d.wait([room])[room] for d in (other, rig.decode)]
        assert sorted(s.state.value for s in got) == ["done", "failed"], got
        [refused] = [s for s in got if s.state is RoomState.FAILED]
        assert refused.reason == f"duplicate want for {room}"
        other.release(room)
        rig.decode.release(room)
    finally:
        other.close()
    check_healthy(rig)


def test_a_second_request_on_a_room_in_use_fails_and_the_first_is_served(rig: Rig) -> None:
    room, fresh_a, fresh_b = rig.next_room(), rig.next_room(), rig.next_room()
    rig.decode.want(room, 9)
    first = prefill(rig, room, 9, seed=11)
    second = prefill(rig, room, 9, seed=12)  # same connection: after the first
    replies = rig.router.wait([first, second])
    assert replies[first].status is OutcomeStatus.OK, replies[first]
    assert replies[second].status is OutcomeStatus.FAILED
    assert "bootstrap_room is already in use" in (replies[second].error or "")
    assert rig.decode.wait([room])[room].state is RoomState.DONE
    # Each prompt alone, for reference. The first one's repeat takes its full pages from the
    # prefix cache and computes the last one on its own: equal within fp32 rounding, not bits.
    for fresh, seed in ((fresh_a, 11), (fresh_b, 12)):
        rig.decode.want(fresh, 9)
        rid = prefill(rig, fresh, 9, seed=seed)
        assert rig.router.wait([rid])[rid].status is OutcomeStatus.OK
        assert rig.decode.wait([fresh])[fresh].state is RoomState.DONE
    for layer in range(NUM_LAYERS):
        got, a, b = (rig.decode.kv(r, 9, layer) for r in (room, fresh_a, fresh_b))
        assert all(torch.allclose(g, x, atol=1e-5) for g, x in zip(got, a, strict=True)), (
            "not the first's KV"
        )
        assert not all(torch.allclose(g, x, atol=1e-2) for g, x in zip(got, b, strict=True))
    for r in (room, fresh_a, fresh_b):
        rig.decode.release(r)
    check_healthy(rig)


# ── identity ─────────────────────────────────────────────────────────────────────────────────


def test_a_taken_name_cannot_be_registered_by_another_connection(rig: Rig, raw) -> None:
    name = rig.decode.receiver.agent_name
    impostor = raw(name)  # a real agent under the victim's name: its metadata is valid
    msg = impostor.register_msg()
    reply, _ = impostor.ask(msgspec.structs.replace(msg, metadata=msg.metadata[:-1]))
    assert isinstance(reply, wire.Registered) and "length mismatch" in (reply.reason or "")
    before = rejects(rig, "name_taken")
    reply, _ = impostor.ask(msg)
    assert isinstance(reply, wire.Registered) and not reply.is_ok
    assert reply.reason == f"agent name {name!r} is registered by another live connection"
    assert rejects(rig, "name_taken") == before + 1
    check_healthy(rig)  # the victim serves on


def test_abort_and_bye_from_a_non_owner_change_nothing(rig: Rig, raw) -> None:
    room = rig.next_room()
    rig.decode.want(room, 9)  # pending, and not yet matched with a request
    stranger, other = raw(), raw()
    reply, _ = other.ask(other.register_msg())
    assert isinstance(reply, wire.Registered) and reply.is_ok
    for peer in (stranger, other):
        reply, _ = peer.ask(wire.Abort(room))
        assert reply == wire.Status(room, "aborted", "aborted by decode")
        peer.send(wire.Bye())
    rid = prefill(rig, room, 9, seed=13)
    assert rig.router.wait([rid])[rid].status is OutcomeStatus.OK
    assert rig.decode.wait([room])[room].state is RoomState.DONE
    rig.decode.release(room)
    check_healthy(rig)


def test_a_multi_frame_message_gets_a_reject(rig: Rig, raw) -> None:
    peer = raw()
    before = rejects(rig, "bad_message")
    peer.sock.send_multipart([wire.encode(wire.Heartbeat()), b"second frame"])
    assert peer.reply() == wire.Reject("a message is one frame, this one has 2")
    assert rejects(rig, "bad_message") == before + 1
    check_healthy(rig)


# ── recovery ─────────────────────────────────────────────────────────────────────────────────


def test_a_dropped_decode_registers_again_by_itself(rig: Rig) -> None:
    from tests.integration.daemon.conftest import Decode

    decode = Decode(rig.worker.bootstrap, peer_timeout_s=60.0)  # pumped only when we say
    try:
        name = decode.receiver.agent_name
        dropped = f"dropping decode peer {name}: decode peer silent"
        wait_until(lambda: dropped in rig.worker.log(), 15.0, "the worker to drop the peer")
        room = rig.next_room()
        decode.want(room, 9)  # refused as unknown; registers again; sent again
        rid = prefill(rig, room, 9, seed=14)
        assert decode.wait([room], 15.0)[room].state is RoomState.DONE
        assert rig.router.wait([rid])[rid].status is OutcomeStatus.OK
    finally:
        decode.close()
    check_healthy(rig)


def test_a_receiver_under_a_live_name_is_refused_with_the_reason(rig: Rig) -> None:
    clone = KVReceiver.from_tensors(
        [torch.zeros_like(k) for k in rig.decode.k],
        [torch.zeros_like(v) for v in rig.decode.v],
        rig.worker.bootstrap,
        num_aux_rows=4,
        agent_name=rig.decode.receiver.agent_name,
    )
    try:
        with pytest.raises(RegistrationError, match="registered by another live connection"):
            clone.wait_registered(10.0)
    finally:
        clone.close()
    check_healthy(rig)


def test_a_refused_decode_fails_its_named_rooms_at_once_and_names_itself_in_timeouts(
    rig_factory,
) -> None:
    """A decode whose registration is refused (a bf16 pool for an fp32 worker) never asks for
    its rooms. Rooms the router named for it fail at once with the refusal, whether they came
    before or after it (before: each waited out the bootstrap timeout and said only "no
    handshake"); a room nobody names still times out, and its error names the refusal."""
    rig = rig_factory("scheduler.bootstrap_timeout_s=6")
    bf16 = RawPeer(rig.worker.bootstrap)
    early = prefill(rig, rig.next_room(), 9, seed=1, decode_peer=bf16.name)
    unnamed = prefill(rig, rig.next_room(), 9, seed=2)
    wrong = dataclasses.replace(LAYOUT, dtype="bfloat16")
    reply, _ = bf16.ask(bf16.register_msg(layout=wrong))
    assert isinstance(reply, wire.Registered) and not reply.is_ok
    late = prefill(rig, rig.next_room(), 9, seed=3, decode_peer=bf16.name)
    answers = rig.router.wait([early, late], timeout_s=30.0)
    # At once, not at the bootstrap timeout: that one's error says "no handshake ..." (as
    # `unnamed`'s below), however long this machine took to ask.
    for rid in (early, late):
        answer = answers[rid]
        assert isinstance(answer, Result) and answer.status is OutcomeStatus.FAILED
        assert f"registration refused: {reply.reason}" == answer.error, answer
    timed_out = rig.router.wait([unnamed], timeout_s=15.0)[unnamed]
    assert isinstance(timed_out, Result) and isinstance(timed_out.error, str)
    assert timed_out.error.startswith("no handshake from the decode peer within 6.0s; ")
    assert f"registrations refused lately: {bf16.name!r} ({reply.reason})" in timed_out.error
    bf16.close()
    check_healthy(rig)


# ── the UCX listener ─────────────────────────────────────────────────────────────────────────


def test_the_worker_listens_on_loopback_only(rig: Rig) -> None:
    """Every bind is 127.0.0.1, so UCX is given ``lo`` (transfer.ucx_net_devices unset)."""
    addresses = listening(rig.worker.proc.pid)
    assert addresses, "no listener found"
    assert {ip for ip, _ in addresses} == {"127.0.0.1"}, addresses
    check_healthy(rig)


def test_listeners_follow_transfer_ucx_net_devices(rig_factory, tmp_path: Path) -> None:
    """With UCX's default (every interface), UCX listens once per interface address, never on
    0.0.0.0; the ZMQ and HTTP sockets keep their 127.0.0.1 binds."""
    open_rig = rig_factory("transfer.ucx_net_devices=all")
    addresses = listening(open_rig.worker.proc.pid)
    assert not {ip for ip, _ in addresses} & {"0.0.0.0", "::"}, addresses
    interfaces = {line.split()[0] for line in Path("/proc/net/dev").read_text().splitlines()[2:]}
    if interfaces - {"lo:"}:
        assert {ip for ip, _ in addresses} - {"127.0.0.1"}, "expected a non-loopback listener"
    check_healthy(open_rig)


# ── CurveZMQ on the bootstrap socket ─────────────────────────────────────────────────────────


def test_curve_on_the_bootstrap_socket_admits_only_allow_listed_decodes(
    tmp_path: Path, checkpoint: Path
) -> None:
    from tests.integration.daemon.conftest import DECODE_PAGES, start_worker, wait_ready
    from tests.reliability.conftest import Ledger, Router

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    worker_public, worker_secret = zmq.auth.create_certificates(str(keys), "worker")
    decode_public, decode_secret = zmq.auth.create_certificates(str(keys), "decode")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    (allowed / "decode.key").write_bytes(Path(decode_public).read_bytes())
    worker = start_worker(
        tmp_path,
        checkpoint,
        f"transfer.curve_secret_key_file={worker_secret}",
        f"transfer.curve_authorized_keys_dir={allowed}",
    )
    shape = (DECODE_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    receivers: list[KVReceiver] = []

    def receiver(curve: CurveClientKeys | None) -> KVReceiver:
        k = [torch.zeros(shape) for _ in range(NUM_LAYERS)]
        v = [torch.zeros(shape) for _ in range(NUM_LAYERS)]
        made = KVReceiver.from_tensors(k, v, worker.bootstrap, num_aux_rows=4, curve=curve)
        receivers.append(made)
        return made

    router = None
    try:
        wait_ready(worker)
        for stranger in (CurveClientKeys.from_files(stranger_secret, worker_public), None):
            with pytest.raises(RegistrationError, match="no answer from the worker"):
                receiver(stranger).wait_registered(1.0)
        decode = receiver(CurveClientKeys.from_files(decode_secret, worker_public))
        decode.wait_registered(10.0)
        router = Router(worker.ingress, Ledger())
        decode.want(7, [5, 9, 3], 1, 0)
        rid = router.send_prefill(prompt(9, seed=7), 7)
        wait_until(lambda: decode.poll(7).state is not RoomState.PENDING, 10.0, "room 7")
        assert decode.poll(7).state is RoomState.DONE, decode.poll(7)
        assert router.wait([rid])[rid].status is OutcomeStatus.OK
        assert worker.proc.poll() is None
    finally:
        if router is not None:
            router.close()
        for made in receivers:
            made.close()
        worker.child.kill()
