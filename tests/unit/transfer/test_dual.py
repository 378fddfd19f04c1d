"""Both protocols at once: a request's room goes to the first protocol whose decode claims it
(or aborts it); the other protocol's sender is failed with a reason that says so, and closed."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.transfer.base import KVPoll, MirroringSender
from prefill_worker.transfer.dual import DualBackend, DualSender
from tests.unit.scheduler.fakes import FakeBackend, FakeSender


def pair() -> tuple[DualSender, FakeSender, FakeSender]:
    native = FakeBackend(PagePool(8), AuxPool(2)).create_sender(5, "r", 12)
    sglang = FakeBackend(PagePool(8), AuxPool(2)).create_sender(5, "r", 12)
    return DualSender([native, sglang], ["native", "sglang"]), native, sglang


def test_the_first_decode_to_claim_the_room_takes_it() -> None:
    dual, native, sglang = pair()
    assert dual.poll() is KVPoll.BOOTSTRAPPING
    sglang.want(num_cached_tokens=4)
    assert dual.poll() is KVPoll.READY and dual.num_cached_tokens() == 4
    assert native.is_closed and native.failure_reason() == (
        "the room was taken by a decode on the sglang protocol"
    )
    pages = sglang.backend.pool.try_alloc(2)
    assert pages is not None
    dual.send_pages(pages, 0)
    assert sglang.sent == [(tuple(pages), 0)] and not native.sent
    native.want()  # too late: nothing reaches the closed one
    assert dual.poll() is KVPoll.TRANSFERRING
    dual.close()
    assert sglang.is_closed and not native.errors and not sglang.errors


def test_a_failure_before_any_claim_fails_both() -> None:
    dual, native, sglang = pair()
    dual.fail("deadline_exceeded")
    assert dual.poll() is KVPoll.FAILED and dual.failure_reason() == "deadline_exceeded"
    assert native.state is KVPoll.FAILED
    dual.close()
    assert native.is_closed and sglang.is_closed
    assert not native.errors and not sglang.errors


def test_an_abort_before_the_request_ends_it() -> None:
    dual, native, sglang = pair()
    native.decode_abort()
    assert dual.poll() is KVPoll.ABORTED
    assert sglang.is_closed and sglang.state is KVPoll.FAILED
    assert dual.transfer_stats().bytes == 0


@dataclass
class PeeredBackend(FakeBackend):
    peers: set[str] = field(default_factory=set)
    num_dropped_peers: int = 0
    bootstrap_endpoint: str = "tcp://127.0.0.1:1"
    endpoints: dict[str, str] = field(default_factory=dict)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self.peers


@dataclass
class Peerless(FakeBackend):
    bootstrap_endpoint: str = "tcp://127.0.0.1:2"
    endpoints: dict[str, str] = field(default_factory=dict)


def test_peers_and_drops_are_every_protocols_that_has_them() -> None:
    """What a tensor-parallel leader watches to mirror drops (``transfer.group``); a
    protocol without peers (vLLM's) adds none."""
    pool, aux = PagePool(8), AuxPool(2)
    native, sglang = PeeredBackend(pool, aux, peers={"a"}), PeeredBackend(pool, aux, peers={"b"})
    native.num_dropped_peers, sglang.num_dropped_peers = 2, 3
    dual = DualBackend({"native": native, "sglang": sglang, "vllm": Peerless(pool, aux)})
    assert dual.num_dropped_peers == 5
    assert dual.has_peer("a") and dual.has_peer("b") and not dual.has_peer("c")


def test_mirror_slots_are_the_chosen_protocols_when_it_mirrors() -> None:
    """``MirroringSender`` passes through: () until a decode claims the room, then the chosen
    sender's slots, or () again when the chosen one does not mirror."""
    mirroring = FakeBackend(PagePool(8), AuxPool(2), mirror=True).create_sender(5, "r", 12)
    plain = FakeBackend(PagePool(8), AuxPool(2)).create_sender(5, "r", 12)
    dual = DualSender([plain, mirroring], ["native", "vllm"])
    assert isinstance(dual, MirroringSender) and dual.mirror_slots(0, 4) == ()
    mirroring.want()
    assert dual.poll() is KVPoll.READY
    assert dual.mirror_slots(4, 6) == [50_004, 50_005] and mirroring.mirrored == [(4, 6)]
    other, _, sglang = pair()
    sglang.want()
    assert other.poll() is KVPoll.READY and other.mirror_slots(0, 4) == ()
