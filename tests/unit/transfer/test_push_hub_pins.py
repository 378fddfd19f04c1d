"""Pins for the push hub (both dialects, on test_push_sender's scripted NIXL agent):
behaviours that mutation testing (`make mutation`, scripts/mutation.py) found no test held."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.push.hub import BUSY_POLL_S, HubBackend, PushHub
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.refusals import RefusedRoom
from prefill_worker.transfer.sglang.dialect import SglangPeer
from tests.unit.transfer.test_push_sender import Rig

WANT_TIMEOUT_S = 5.0  # the rig's


@pytest.fixture(params=["native", "sglang"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return Rig(request.param)


def other_peer(rig: Rig, name: str = "decode-2") -> Peer:
    peer = dataclasses.replace(
        rig.peer, identity=name.encode(), agent_name=name, rooms=set(), unmatched=set()
    )
    rig.hub.peers[peer.identity] = peer
    return peer


def spy(rig: Rig) -> list[tuple[str, wire.Status]]:
    """Every status the hub sends, with the agent it goes to."""
    sent: list[tuple[str, wire.Status]] = []
    send = rig.ctx.dialect.send

    def spying(peer: Peer, status: wire.Status, generation: int | None = None) -> bool:
        sent.append((peer.agent_name, status))
        return bool(send(peer, status, generation))

    rig.ctx.dialect.send = spying  # type: ignore[method-assign]
    return sent


def want(room: int, pages: Any = (3, 4, 5, 6)) -> wire.Want:
    return wire.Want.of(room, list(pages), 2, 0)


def test_a_second_request_for_a_room_in_use_fails_alone(rig: Rig) -> None:
    first = rig.bound_sender()
    second = rig.hub.create_sender(7, "req-b", 16)
    assert second.poll() is KVPoll.FAILED
    assert second.failure_reason() == "its bootstrap_room is already in use by another request"
    assert first.poll() is KVPoll.READY and rig.hub.senders[7] is first
    second.close()
    rig.hub.drain()  # the room is the first request's: no late want hears the second's end
    assert rig.hub.rooms.gone(7) is None and rig.hub.senders[7] is first
    rig.hub.check_integrity()


def test_wants_for_a_bound_or_a_foreign_room_are_refused_with_their_code(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    sender = rig.bound_sender()
    other = other_peer(rig)
    sent = spy(rig)
    named = rig.hub.create_sender(8, "req-8", 16, allowed_peer="decode-1")
    with caplog.at_level(logging.DEBUG, logger="prefill_worker.transfer.push.refusals"):
        rig.hub.want(other, want(7))
        rig.hub.want(other, want(8))
    assert sent == [
        ("decode-2", wire.Status(7, "failed", "duplicate want for 7", "duplicate_want")),
        (
            "decode-2",
            wire.Status(
                8,
                "failed",
                "room 8 is reserved by the router for another decode peer",
                "foreign_room",
            ),
        ),
    ]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [  # rooms are private
        (logging.DEBUG, "test: duplicate_want: duplicate want for 7"),
        (
            logging.DEBUG,
            "test: foreign_room: room 8 is reserved by the router for another decode peer",
        ),
    ]
    assert rig.hub.counter.counts == {"duplicate_want": 1, "foreign_room": 1}
    assert sender.peer is rig.peer and named.peer is None
    assert named.poll() is KVPoll.BOOTSTRAPPING
    rig.hub.want(rig.peer, want(8))  # the named decode's own want binds
    assert named.poll() is KVPoll.READY and rig.peer.rooms == {7, 8}
    rig.hub.want(rig.peer, want(8))  # its own decode again: a duplicate, not a foreign room
    assert sent[-1][1].code == "duplicate_want"
    rig.hub.check_integrity()


def test_a_gone_room_tells_its_decodes_late_want_once_until_forgotten(rig: Rig) -> None:
    other = other_peer(rig)
    for room in (7, 8):
        sender = rig.hub.create_sender(room, f"req-{room}", 16, allowed_peer="decode-1")
        sender.fail("the engine gave up")
        sender.close()
    rig.hub.drain()
    sent = spy(rig)
    rig.hub.want(other, want(7))  # not the decode the router named
    assert sent[-1][1].reason == "room 7 is reserved by the router for another decode peer"
    rig.hub.want(rig.peer, want(7))
    assert sent[-1] == ("decode-1", wire.Status(7, "failed", "the engine gave up"))
    rig.hub.want(rig.peer, want(7))  # told once: this one waits for a request
    assert len(sent) == 2 and rig.hub.rooms.num_claims(7) == 1
    rig.hub.turn(rig.now + WANT_TIMEOUT_S - 0.1)
    assert rig.hub.rooms.gone(8) is not None
    rig.hub.turn(rig.now + WANT_TIMEOUT_S)  # forgotten at its bound
    assert rig.hub.rooms.gone(8) is None


def test_a_want_the_peer_cannot_park_is_refused(rig: Rig) -> None:
    sent = spy(rig)
    rig.hub.want(rig.peer, want(9, range(17)))  # the decode pool has 16 pages
    [(_, status)] = sent
    assert (status.status, status.code) == ("failed", "too_many_wants")
    assert rig.hub.rooms.num_claims(9) == 0


def test_the_first_acceptable_claim_wins_and_the_others_are_refused(rig: Rig) -> None:
    other = other_peer(rig)
    rig.hub.want(rig.peer, want(7))
    rig.hub.want(other, want(7))
    sent = spy(rig)
    sender = rig.hub.create_sender(7, "req-7", 16, allowed_peer="decode-2")
    assert sender.peer is other and other.rooms == {7} and not rig.peer.rooms
    assert [(name, s.code) for name, s in sent] == [("decode-1", "foreign_room")]
    rig.hub.want(rig.peer, want(8))
    rig.hub.want(other, want(8))
    sender = rig.hub.create_sender(8, "req-8", 16)
    assert sender.peer is rig.peer
    assert [(name, s.code) for name, s in sent[1:]] == [("decode-2", "duplicate_want")]
    rig.hub.check_integrity()


def test_a_claim_whose_request_never_comes_is_told_so_at_its_deadline(rig: Rig) -> None:
    rig.hub.want(rig.peer, want(9))
    assert rig.hub.next_poll_at(rig.now) == rig.now + WANT_TIMEOUT_S
    sent = spy(rig)
    rig.hub.turn(rig.now + WANT_TIMEOUT_S - 0.1)
    assert not sent
    rig.hub.turn(rig.now + WANT_TIMEOUT_S)
    assert sent == [("decode-1", wire.Status(9, "failed", "prefill request never arrived"))]
    assert rig.hub.next_poll_at(rig.now) is None


def test_the_next_poll_is_now_for_events_and_soon_for_writes_in_flight(rig: Rig) -> None:
    assert rig.hub.next_poll_at(rig.now) is None
    sender = rig.bound_sender()
    assert rig.hub.next_poll_at(rig.now) is None  # bound, idle: nothing to watch
    sender.send_pages([0], 0)
    assert rig.hub.next_poll_at(rig.now) == rig.now + BUSY_POLL_S
    sender.fail("boom")  # its status waits in the events
    assert rig.hub.next_poll_at(rig.now) == rig.now


def test_an_abort_of_a_waiting_want_is_remembered_for_the_want_timeout(rig: Rig) -> None:
    for room in (7, 8):
        rig.hub.want(rig.peer, want(room))
        rig.hub.abort(rig.peer, room)
    rig.hub.turn(rig.now + WANT_TIMEOUT_S - 0.1)
    assert rig.hub.create_sender(7, "req-7", 16).poll() is KVPoll.ABORTED
    rig.hub.turn(rig.now + WANT_TIMEOUT_S)
    assert rig.hub.create_sender(8, "req-8", 16).poll() is KVPoll.BOOTSTRAPPING


def test_an_aborted_or_refused_room_ends_only_the_request_naming_that_decode(rig: Rig) -> None:
    for room in (7, 8):
        rig.hub.want(rig.peer, want(room))
        rig.hub.abort(rig.peer, room, generation=4)
    generation = 4 if isinstance(rig.peer, SglangPeer) else None  # SGLang echoes it
    assert [g for *_, g in rig.heard.said] == [generation] * 2
    assert rig.hub.create_sender(7, "r7", 16, allowed_peer="decode-1").poll() is KVPoll.ABORTED
    assert rig.hub.create_sender(8, "r8", 16, allowed_peer="decode-2").poll() is (
        KVPoll.BOOTSTRAPPING
    )
    rig.refusals.rooms.add(9, RefusedRoom("decode-1", "no such pool"), rig.now)
    refused = rig.hub.create_sender(9, "r9", 16, allowed_peer="decode-1")
    assert refused.failure_reason() == "no such pool"


def test_closing_the_hub_ends_every_sender_and_peer(rig: Rig) -> None:
    sender = rig.bound_sender()
    rig.hub.want(rig.peer, want(9))
    rig.hub.close()
    assert sender.is_closed and sender.poll() is KVPoll.FAILED
    assert not rig.hub.peers and not rig.hub.senders and rig.agent.forgotten == ["decode-1"]
    assert [(room, code) for room, code, *_ in rig.heard.said] == [(7, "failed"), (9, "failed")]
    assert rig.heard.said[0][2] == "the request ended before its transfer"
    assert (rig.heard.said[1][2] or "").endswith("prefill worker shutting down")


def test_closing_the_hub_tells_what_waited_on_writes_nixl_would_not_release(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.agent.refuse_release = True
    sender = rig.bound_sender()
    sender.send_pages([0], 0)
    sender.fail("boom")
    rig.hub.drain()  # held: its write may still land
    assert rig.heard.said == []
    with caplog.at_level(logging.ERROR, logger="prefill_worker.transfer.nixl.reaper"):
        rig.hub.close()
    assert rig.heard.said[0] == (7, "failed", "boom", None)
    assert "request req-7: NIXL refused to release a write" in [
        r.getMessage() for r in caplog.records
    ]


def test_a_closing_sender_is_in_the_tables_until_drained(rig: Rig) -> None:
    sender = rig.bound_sender()
    sender.close()
    rig.hub.check_integrity()  # closed, its Closed not yet done: consistent
    rig.hub.drain()
    assert not rig.hub.senders
    rig.hub.check_integrity()


def test_statuses_held_on_writes_are_polled_soon_without_busy_polling(rig: Rig) -> None:
    rig.ctx.poster.needs_polling = False  # type: ignore[misc]  # a transfer thread wakes us
    sender = rig.bound_sender()
    sender.send_pages([0], 0)
    sender.fail("boom")
    rig.hub.drain()  # the status is held on its write
    at = rig.hub.next_poll_at(rig.now)
    assert at is not None and rig.now < at <= rig.now + 1.0


def test_a_stuck_peer_is_dropped_only_when_known(rig: Rig) -> None:
    sender = rig.bound_sender()
    rig.hub.drop_stuck_peer(None)
    rig.hub.drop_stuck_peer(b"nobody")
    assert rig.hub.peers and sender.poll() is KVPoll.READY
    rig.hub.drop_stuck_peer(rig.peer.identity)
    assert not rig.hub.peers and sender.failure_reason() == "writes could not be cancelled"


def test_no_identity_drops_no_peer_whatever_its_name(rig: Rig) -> None:
    odd = other_peer(rig, "XXXX")
    rig.hub.drop_stuck_peer(None)
    assert rig.hub.peers[b"XXXX"] is odd


def test_dropping_a_peer_is_logged_with_its_protocol_and_reason(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="prefill_worker.transfer.push.hub"):
        rig.hub.drop_peer(rig.peer, "decode peer left")
    assert [r.getMessage() for r in caplog.records] == [
        "test: dropping decode peer decode-1: decode peer left"
    ]


def test_integrity_fails_on_tables_that_disagree(rig: Rig) -> None:
    sender = rig.bound_sender()
    rig.hub.check_integrity()
    rig.hub.senders[8] = sender  # filed under another room
    with pytest.raises(AssertionError):
        rig.hub.check_integrity()
    del rig.hub.senders[8]
    rig.peer.rooms.add(9)  # a room the peer does not hold
    rig.hub.senders[9] = rig.hub.create_sender(99, "req-99", 16)
    with pytest.raises(AssertionError):
        rig.hub.check_integrity()


def test_integrity_fails_on_two_peers_of_one_name(rig: Rig) -> None:
    twin = dataclasses.replace(rig.peer, identity=b"twin", rooms=set(), unmatched=set())
    rig.hub.peers[b"twin"] = twin
    with pytest.raises(AssertionError, match=r"^one peer per agent name$"):
        rig.hub.check_integrity()


class Backend(HubBackend[Any]):
    def __init__(self, hub: PushHub[Any]) -> None:
        self._hub = hub


def test_a_hub_backend_answers_from_its_hub(rig: Rig) -> None:
    backend = Backend(rig.hub)
    sender = backend.create_sender(7, "req-7", 16, "decode-1")
    assert sender is rig.hub.senders[7] and rig.hub.senders[7].allowed_peer == "decode-1"
    assert rig.hub.senders[7].num_prompt_tokens == 16 and rig.hub.senders[7].room == 7
    assert rig.hub.senders[7].request_id == "req-7"
    rig.hub.want(rig.peer, want(8))
    assert (backend.num_open_senders, backend.num_peers, backend.num_claims(8)) == (1, 1, 1)
    assert backend.has_peer("decode-1") and not backend.has_peer("decode-2")
    assert backend.num_inflight_transfers() == 0
    backend.check_integrity()


def test_a_hub_backend_counts_the_peers_it_dropped(rig: Rig) -> None:
    """What a tensor-parallel leader watches to mirror drops (``transfer.group``)."""
    backend = Backend(rig.hub)
    odd = other_peer(rig, "XXXX")
    assert backend.num_dropped_peers == 0
    rig.hub.drop_peer(rig.peer, "decode peer left")
    rig.hub.drop_peer(odd, "decode peer left")
    assert backend.num_dropped_peers == 2 and not backend.has_peer("decode-1")


def test_a_bound_sender_closed_leaves_no_gone_mark(rig: Rig) -> None:
    """Only a sender no decode bound is remembered as gone (a late want learns why); one that
    was bound leaves its room free: a new want for it waits for its request."""
    sender = rig.bound_sender()
    sender.close()
    rig.hub.drain()
    heard = len(rig.heard.said)
    rig.hub.want(rig.peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    rig.hub.drain()
    assert len(rig.heard.said) == heard  # not refused: waiting for a request
    assert 7 in rig.peer.unmatched
