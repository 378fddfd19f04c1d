"""The deadline heap: a deadline expires at exactly its time, in time order, ties in the order
they were pushed."""

from __future__ import annotations

from prefill_worker.request import PrefillRequest, SamplingParams
from prefill_worker.scheduler.deadlines import DeadlineHeap, DeadlineKind
from prefill_worker.scheduler.tracked import Request


def request(request_id: str) -> Request:
    return Request(PrefillRequest(request_id, [1, 2], SamplingParams(), False, 0, 0.0), None)


def test_deadlines_expire_at_their_time_in_order_and_ties_in_push_order() -> None:
    heap = DeadlineHeap()
    assert heap.next_at() is None and heap.pop_expired(100.0) == []
    a, b, c = request("a"), request("b"), request("c")
    heap.push(2.0, DeadlineKind.REQUEST, c)
    heap.push(1.0, DeadlineKind.BOOTSTRAP, a)
    heap.push(1.0, DeadlineKind.TRANSFER, b)
    assert len(heap) == 3 and heap.next_at() == 1.0
    assert heap.pop_expired(0.5) == []
    assert heap.pop_expired(1.0) == [(DeadlineKind.BOOTSTRAP, a), (DeadlineKind.TRANSFER, b)]
    assert heap.next_at() == 2.0 and len(heap) == 1
    assert heap.pop_expired(2.0) == [(DeadlineKind.REQUEST, c)]
    assert len(heap) == 0 and heap.next_at() is None
