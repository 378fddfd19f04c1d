"""Holds on staged blocks for vLLM decodes, on a fake clock: READ notifications release at the
consumer count, heartbeats extend to two thirds of the lease, expiry frees only after the
read grace, unknown and malformed notifications are counted and ignored."""

from __future__ import annotations

import pytest

from prefill_worker.transfer.vllm.holds import MAX_LEASES, BadNotification, HoldTable


def _table() -> HoldTable:
    return HoldTable(lease_s=30.0, read_grace_s=5.0)


def test_reads_release_when_every_consumer_has_read() -> None:
    holds = _table()
    holds.hold("r1", (4, 5), now=0.0)
    assert holds.notify("r1:2", now=1.0, agent="d0") == []
    assert "r1" in holds
    assert holds.notify("r1:2", now=1.5, agent="d0") == []  # d0 counts once
    assert holds.notify("r1:2", now=2.0, agent="d1") == [4, 5]
    assert "r1" not in holds and holds.counts.released_by_reads == 1
    assert holds.expire(now=100.0) == []  # its stale deadline frees nothing twice


def test_unknown_and_late_notifications_are_counted_and_ignored() -> None:
    holds = _table()
    holds.hold("r1", (1,), now=0.0)
    assert holds.notify("other:1", now=1.0, agent="d0") == []
    assert holds.expire(now=30.0) == []  # expired, in its grace
    assert (
        holds.notify("r1:1", now=31.0, agent="d0") == []
    )  # after expiry: unknown, never a double free
    assert holds.counts.unknown_notifications == 2
    with pytest.raises(BadNotification):
        holds.notify("no-colon", now=1.0, agent="d0")
    with pytest.raises(BadNotification):
        holds.notify("r1:zero", now=1.0, agent="d0")
    assert holds.counts.bad_notifications == 2


def test_expiry_frees_only_after_the_read_grace() -> None:
    holds = _table()
    holds.hold("r1", (7, 8), now=0.0)
    assert holds.next_deadline() == 30.0
    assert holds.expire(now=29.9) == []
    assert holds.expire(now=30.0) == []  # lease over: nothing new may start reading...
    assert holds.counts.expired == 1 and "r1" not in holds
    assert holds.next_deadline() == 35.0
    assert holds.expire(now=34.9) == []  # ...but a READ posted before may still be in flight
    assert holds.expire(now=35.0) == [7, 8]
    assert holds.next_deadline() is None


def test_heartbeats_extend_to_two_thirds_of_the_lease() -> None:
    holds = _table()
    holds.hold("r1", (1,), now=0.0)
    holds.hold("r2", (2,), now=0.0)
    holds.notify("HB:r1,unknown", now=25.0, agent="d0")  # r1: max(30, 25 + 20) = 45
    holds.notify("HB:r2", now=5.0, agent="d0")  # r2: 5 + 20 < 30, unchanged
    assert holds.counts.heartbeats == 2
    holds.expire(now=30.0)
    assert "r1" in holds and "r2" not in holds
    holds.expire(now=44.9)
    assert "r1" in holds
    holds.expire(now=45.0)
    assert "r1" not in holds and holds.counts.expired == 2


def test_release_all_returns_held_and_quarantined_blocks() -> None:
    holds = _table()
    holds.hold("r1", (1, 2), now=0.0)
    holds.hold("r2", (3,), now=10.0)
    holds.expire(now=30.0)  # r1 in its grace
    assert sorted(holds.release_all()) == [1, 2, 3]
    assert len(holds) == 0 and holds.next_deadline() is None


def test_only_the_holds_readers_notify_and_each_counts_once() -> None:
    """The first agent to name a hold is its reader (or the first ``consumers`` agents); a
    third agent's READ or heartbeat changes nothing and is counted."""
    holds = _table()
    holds.hold("r1", (1,), now=0.0)
    holds.notify("HB:r1", now=1.0, agent="decode")  # the decode's own heartbeat: its reader
    assert holds.notify("r1:1", now=2.0, agent="thief") == []
    holds.notify("HB:r1", now=25.0, agent="thief")  # no extension from a stranger
    assert holds.counts.foreign_notifications == 2 and "r1" in holds
    holds.expire(now=30.0)
    assert "r1" not in holds and holds.counts.expired == 1  # the stranger's HB did not keep it
    holds.hold("r2", (2,), now=40.0)
    assert holds.notify("r2:1", now=41.0, agent="thief") == [2]  # first to name it: its reader


def test_a_heartbeated_hold_lives_at_most_max_leases() -> None:
    holds = _table()
    holds.hold("r1", (1,), now=0.0)
    now = 0.0
    while now < MAX_LEASES * 30.0 + 60.0:  # the reader heartbeats every lease / 6
        holds.notify("HB:r1", now=now, agent="d0")
        holds.expire(now=now)
        if "r1" not in holds:
            break
        now += 5.0
    assert "r1" not in holds and now == MAX_LEASES * 30.0
