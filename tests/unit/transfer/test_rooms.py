"""Wants that wait for their requests: bounded per room, per peer and by the peer's own pool;
taken once, in arrival order; every index kept in step."""

from __future__ import annotations

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.rooms import Gone, RoomBook
from prefill_worker.transfer.validate import RejectReason

LAYOUT = KVLayout(1, 1, 8, "float32", 4, 10)


def peer(name: str, num_pages: int = 10) -> Peer:
    layout = KVLayout(1, 1, 8, "float32", 4, num_pages)
    return Peer(
        name.encode(), name, KVRegions(layout, (4096,), (8192,), "cpu", 16384, 4), None, 0.0
    )


def want(room: int, num_pages: int) -> wire.Want:
    return wire.Want.of(room, range(num_pages), 0, 0)


def test_claims_are_taken_once_in_arrival_order() -> None:
    book, a, b = RoomBook(4, 100), peer("a"), peer("b")
    assert book.claim(a, want(1, 2), 5.0) is None
    assert book.claim(b, want(1, 3), 5.0) is None
    book.check_integrity([a, b])
    assert [c.peer for c in book.take(1)] == [a, b]
    assert book.take(1) == [] and book.num_claims(1) == 0
    assert a.num_claimed_pages == b.num_claimed_pages == 0 and not a.unmatched
    book.check_integrity([a, b])


def test_one_claim_per_peer_and_a_few_per_room() -> None:
    book, peers = RoomBook(2, 100), [peer(f"p{i}") for i in range(3)]
    assert book.claim(peers[0], want(1, 1), 5.0) is None
    refusal = book.claim(peers[0], want(1, 1), 5.0)
    assert refusal is not None and refusal.reason is RejectReason.DUPLICATE_WANT
    assert book.claim(peers[1], want(1, 1), 5.0) is None
    refusal = book.claim(peers[2], want(1, 1), 5.0)
    assert refusal is not None and refusal.message == "duplicate want for 1"
    book.check_integrity(peers)


def test_every_rank_of_a_wide_decode_waits_on_its_room() -> None:
    """A decode of TP 8 sends a want from each rank, often before the request: all eight wait
    (the bound is the decode's rank count when it has more ranks than the room bound); a
    ninth peer is still refused."""
    book, ranks = RoomBook(4, 100), [peer(f"r{i}") for i in range(9)]
    for rank in ranks:
        rank.tp_size = 8
    for rank in ranks[:8]:
        assert book.claim(rank, want(1, 1), 5.0) is None
    refusal = book.claim(ranks[8], want(1, 1), 5.0)
    assert refusal is not None and refusal.reason is RejectReason.DUPLICATE_WANT
    assert [c.peer for c in book.take(1)] == ranks[:8]
    book.check_integrity(ranks)


def test_a_peer_parks_no_more_pages_than_its_pool_has() -> None:
    book, a = RoomBook(4, 100), peer("a", num_pages=10)
    assert book.claim(a, want(1, 6), 5.0) is None
    refusal = book.claim(a, want(2, 5), 5.0)
    assert refusal is not None and refusal.reason is RejectReason.TOO_MANY_WANTS
    assert refusal.message == (
        "wants waiting for their requests would name 11 pages; the decode pool has 10"
    )
    assert book.drop(1, a) and not book.drop(1, a)
    assert book.claim(a, want(2, 5), 5.0) is None
    book.check_integrity([a])


def test_a_peer_parks_a_bounded_number_of_rooms() -> None:
    book, a = RoomBook(4, 2), peer("a")
    assert book.claim(a, want(1, 0), 5.0) is None and book.claim(a, want(2, 0), 5.0) is None
    refusal = book.claim(a, want(3, 0), 5.0)
    assert refusal is not None and refusal.message == "2 wants already wait for their requests"


def test_expiry_drops_claims_and_forgets_gone_rooms() -> None:
    book, a = RoomBook(4, 100), peer("a")
    book.claim(a, want(1, 2), 1.0)
    book.claim(a, want(2, 2), 3.0)
    book.mark_gone(7, Gone("never wanted", None, 2.0))
    assert [c.want.room for c in book.pop_expired(2.0)] == [1]
    assert book.gone(7) is None and a.unmatched == {2} and a.num_claimed_pages == 2
    book.check_integrity([a])
