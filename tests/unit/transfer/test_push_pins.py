"""Pins for the push engine's room tables and refusal records: behaviours that mutation
testing (`make mutation`, scripts/mutation.py) found no test held."""

from __future__ import annotations

import logging

import pytest

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.refusals import ExpiringTable, RejectCounter, summary
from prefill_worker.transfer.push.rooms import Gone, RoomBook
from prefill_worker.transfer.validate import RejectReason


def peer(name: str, num_pages: int = 10) -> Peer:
    layout = KVLayout(1, 1, 8, "float32", 4, num_pages)
    regions = KVRegions(layout, (4096,), (8192,), "cpu", 16384, 4)
    return Peer(name.encode(), name, regions, None, 0.0)  # type: ignore[arg-type]


def want(room: int, num_pages: int) -> wire.Want:
    return wire.Want.of(room, range(num_pages), 0, 0)


# -- rooms ------------------------------------------------------------------------------


def test_a_peer_may_park_exactly_its_pool_and_too_many_rooms_is_typed() -> None:
    book: RoomBook[Peer] = RoomBook(4, 1)
    a = peer("a", num_pages=10)
    assert book.claim(a, want(1, 10), 5.0) is None  # the whole pool, not one page more
    refusal = book.claim(a, want(2, 0), 5.0)
    assert refusal is not None and refusal.reason is RejectReason.TOO_MANY_WANTS
    book.check_integrity([a])


def test_dropping_one_peers_claim_keeps_the_others_and_its_other_pages() -> None:
    book: RoomBook[Peer] = RoomBook(4, 100)
    a, b = peer("a"), peer("b")
    assert book.claim(a, want(1, 2), 5.0) is None and book.claim(b, want(1, 1), 5.0) is None
    assert book.claim(a, want(2, 3), 5.0) is None
    assert book.drop(1, a)
    assert a.num_claimed_pages == 3 and a.unmatched == {2}
    book.check_integrity([a, b])
    assert [c.peer for c in book.take(1)] == [b]


def test_the_first_deadline_and_a_claim_expires_at_it() -> None:
    book: RoomBook[Peer] = RoomBook(4, 100)
    a = peer("a")
    assert book.next_deadline() is None
    book.claim(a, want(1, 1), 3.0)
    book.claim(a, want(2, 1), 1.0)
    assert book.next_deadline() == 1.0
    assert [c.want.room for c in book.pop_expired(1.0)] == [2]  # due at its deadline
    assert book.next_deadline() == 3.0


def test_a_gone_room_is_told_until_forgotten_or_its_request_comes() -> None:
    book: RoomBook[Peer] = RoomBook(4, 100)
    gone = Gone("request ended before any want", "d0", 9.0)
    book.mark_gone(7, gone)
    book.mark_gone(8, gone)
    assert book.gone(7) is gone and book.gone(9) is None
    book.forget_gone(7)
    book.forget_gone(99)  # forgetting a room never marked is no error
    assert book.gone(7) is None and book.gone(8) is gone
    assert book.take(8) == [] and book.gone(8) is None


def test_an_aborted_room_is_taken_once_until_its_time() -> None:
    book: RoomBook[Peer] = RoomBook(4, 100)
    book.mark_aborted(3, "d0", forget_at=2.0)
    book.mark_aborted(4, "d1", forget_at=2.0)
    assert book.take_aborted(3) == "d0" and book.take_aborted(3) is None
    assert book.take_aborted(5) is None
    book.pop_expired(1.9)
    assert book.take_aborted(4) == "d1"
    book.mark_aborted(4, "d1", forget_at=2.0)
    book.pop_expired(2.0)  # forgotten at its bound
    assert book.take_aborted(4) is None


def test_integrity_fails_when_a_claims_room_is_missing_from_its_peer() -> None:
    book: RoomBook[Peer] = RoomBook(4, 100)
    a = peer("a")
    book.claim(a, want(1, 1), 5.0)
    a.unmatched.discard(1)
    with pytest.raises(AssertionError):
        book.check_integrity([])


# -- refusals ---------------------------------------------------------------------------


def test_a_refused_name_added_again_is_the_newest() -> None:
    names: ExpiringTable[str, str] = ExpiringTable(keep_s=10.0, max_items=2)
    names.add("a", "why a", now=0.0)
    names.add("b", "why b", now=0.0)
    names.add("a", "why a again", now=1.0)
    names.add("c", "why c", now=1.0)  # pushes out the oldest: b
    assert names.get("b", now=1.0) is None and names.get("a", now=1.0) == "why a again"
    names.clear("nobody")  # clearing what is not there is no error


def test_the_summary_drops_a_refusal_at_its_bound() -> None:
    names: ExpiringTable[str, str] = ExpiringTable(keep_s=10.0, max_items=2)
    names.add("a", "why", now=0.0)
    assert summary(names, 9.99) is not None and summary(names, 10.0) is None


def test_every_refusal_is_counted_reported_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    heard: list[str] = []
    counter = RejectCounter("sglang", heard.append)
    with caplog.at_level(logging.DEBUG, logger="prefill_worker.transfer.push.refusals"):
        counter.count(RejectReason.BAD_NAME, "name taken twice")
        counter.count(RejectReason.BAD_NAME, "again", logging.INFO)
        counter.count(RejectReason.TOO_LARGE, "10 pages")
    assert counter.counts == {"bad_name": 2, "too_large": 1}
    assert heard == ["bad_name", "bad_name", "too_large"]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "sglang: bad_name: name taken twice"),
        (logging.INFO, "sglang: bad_name: again"),
        (logging.WARNING, "sglang: too_large: 10 pages"),
    ]
    quiet = RejectCounter("bootstrap")  # no metric hook: counted all the same
    quiet.count(RejectReason.BAD_WANT, "x")
    assert quiet.counts == {"bad_want": 1} and quiet.protocol == "bootstrap"
