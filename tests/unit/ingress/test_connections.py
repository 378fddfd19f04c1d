"""RouterConnections: which routing id a disconnect names, fd reuse and late first messages."""

from __future__ import annotations

from prefill_worker.ingress.connections import RouterConnections


def test_a_disconnect_names_the_id_seen_on_that_connection() -> None:
    conns = RouterConnections()
    assert list(conns.on_accepted(7)) == []
    assert conns.try_add(b"A", 7) and b"A" in conns
    assert list(conns.on_accepted(8)) == []
    assert conns.try_add(b"B", 8)
    assert list(conns.on_disconnected(7)) == [b"A"]
    assert b"A" not in conns and b"B" in conns and len(conns) == 1


def test_a_connection_that_never_spoke_names_nobody() -> None:
    conns = RouterConnections()
    list(conns.on_accepted(7))
    assert list(conns.on_disconnected(7)) == []
    assert list(conns.on_disconnected(99)) == []  # never accepted (or already gone)


def test_a_reused_fd_belongs_to_the_new_connection() -> None:
    conns = RouterConnections()
    list(conns.on_accepted(7))
    conns.try_add(b"A", 7)
    assert list(conns.on_disconnected(7)) == [b"A"]
    list(conns.on_accepted(7))
    assert conns.try_add(b"B", 7)
    assert list(conns.on_disconnected(7)) == [b"B"]


def test_a_first_message_read_after_its_connection_closed_is_from_a_gone_router() -> None:
    conns = RouterConnections()
    list(conns.on_accepted(7))
    list(conns.on_disconnected(7))
    assert not conns.try_add(b"A", 7)  # its connection closed before we read its message
    list(conns.on_accepted(7))
    assert conns.try_add(b"B", 7)
    assert not conns.try_add(b"A", 7)  # fd 7 is B's connection now
    assert b"A" not in conns and b"B" in conns


def test_a_missed_disconnect_is_caught_by_the_next_accept_on_the_fd() -> None:
    conns = RouterConnections()
    list(conns.on_accepted(7))
    conns.try_add(b"A", 7)
    assert list(conns.on_accepted(7)) == [b"A"]
    assert b"A" not in conns


def test_no_fd_means_no_tracking() -> None:
    conns = RouterConnections()
    assert conns.try_add(b"inproc", -1)
    assert b"inproc" not in conns
