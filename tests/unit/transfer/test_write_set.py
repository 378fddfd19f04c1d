"""``WriteSet``: the bookkeeping both senders share. DONE writes are counted and released,
a failed or overdue write gives the reason, released writes stay pending until they settle
(a status must wait for them), and the unsettled ones are what a closing sender hands on."""

from __future__ import annotations

import pytest

from prefill_worker.request import TransferStats
from prefill_worker.transfer.nixl.writes import WriteSet


class FakeWrite:
    """A ``poster.Write`` whose state the test sets; ``settles_on_release`` False models a
    release still under way on the transfer thread."""

    def __init__(
        self,
        num_bytes: int = 10,
        settles_on_release: bool = True,
        num_descs: int = 2,
        telemetry: tuple[float, float] | None = None,
    ) -> None:
        self.num_bytes, self.prep_s, self.prep_cpu_s = num_bytes, 0.5, 0.25
        self.num_descs, self.telemetry = num_descs, telemetry
        self.status = "PROC"
        self.num_releases = 0
        self.settles_on_release = settles_on_release
        self.is_refused = False
        self._is_settled = False

    def state(self) -> str:
        return self.status

    def release(self) -> None:
        self.num_releases += 1
        self._is_settled = self._is_settled or self.settles_on_release

    @property
    def is_settled(self) -> bool:
        return self._is_settled

    def settle(self) -> None:
        self._is_settled = True


def test_done_writes_are_counted_and_released() -> None:
    writes = WriteSet(timeout_s=5.0)
    a, b = FakeWrite(10), FakeWrite(20)
    writes.add(a, now=0.0)
    writes.add(b, now=0.0)
    a.status = "DONE"
    assert writes.check(now=1.0) is None
    assert len(writes) == 1 and writes.written_bytes == 10
    assert (writes.prep_s, writes.prep_cpu_s) == (0.5, 0.25)
    assert a.num_releases == 1 and writes.pending() == (b,)


def test_the_first_failure_is_the_reason_and_an_overdue_write_stays() -> None:
    writes = WriteSet(timeout_s=5.0)
    failed, slow = FakeWrite(), FakeWrite()
    writes.add(failed, now=0.0)
    writes.add(slow, now=1.0)
    failed.status = "ERR (remote gone)"
    assert writes.check(now=2.0) == "NIXL write failed: ERR (remote gone)"
    assert failed.num_releases == 1 and writes.written_bytes == 0
    assert writes.check(now=5.9) is None  # slow's deadline is 6.0
    assert writes.check(now=6.0) == "write still in flight after 5 s"
    assert writes.pending() == (slow,)  # overdue writes stay until released


def test_released_writes_stay_pending_until_they_settle() -> None:
    writes = WriteSet(timeout_s=5.0)
    quick, slow = FakeWrite(), FakeWrite(settles_on_release=False)
    writes.add(quick, now=0.0)
    writes.add(slow, now=0.0)
    writes.release_all()
    assert len(writes) == 0
    assert writes.pending() == (slow,) and writes.unsettled() == (slow,)
    slow.settle()
    assert writes.check(now=1.0) is None
    assert writes.pending() == () and writes.unsettled() == ()


def test_stats_count_this_agents_writes_their_descriptors_and_nixls_telemetry() -> None:
    writes = WriteSet(timeout_s=5.0)
    assert writes.stats() == TransferStats()
    kv = FakeWrite(100, num_descs=8, telemetry=(0.001, 0.004))
    aux = FakeWrite(32, num_descs=1, telemetry=(0.0005, 0.002))
    others = FakeWrite(0, num_descs=0)  # another rank's writes, waited for as one: not counted
    failed = FakeWrite(64, num_descs=4, telemetry=(1.0, 1.0))
    for write in (kv, aux, others, failed):
        writes.add(write, now=0.0)
    kv.status = aux.status = others.status = "DONE"
    failed.status = "ERR (remote gone)"
    writes.check(now=1.0)
    stats = writes.stats()
    assert (stats.bytes, stats.writes, stats.descriptors) == (132, 2, 9)
    assert stats.nixl_post_s == pytest.approx(0.0015) and stats.nixl_xfer_s == pytest.approx(0.006)


def test_without_telemetry_the_stats_say_none_rather_than_zero() -> None:
    writes = WriteSet(timeout_s=5.0)
    write = FakeWrite(10, num_descs=3)
    writes.add(write, now=0.0)
    write.status = "DONE"
    writes.check(now=0.5)
    assert writes.stats() == TransferStats(10, 1, 3, None, None)
