"""Batch building's edges, through ``Admission`` itself: plans are numbered 1, 2, 3, ...; a
chunk never starts at or past its prompt's end; a request is added to the queues once (found
unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import pytest

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.tables import PageTable
from prefill_worker.request import PrefillRequest, RequestState, SamplingParams
from prefill_worker.scheduler.admission import Admission
from prefill_worker.scheduler.chunking import chunk_end
from prefill_worker.scheduler.queues import RequestQueues
from prefill_worker.scheduler.tracked import Request


def request(request_id: str, num_tokens: int) -> Request:
    prompt = PrefillRequest(request_id, [1] * num_tokens, SamplingParams(), False, 0, 0.0)
    return Request(prompt, None)


def test_plans_are_numbered_from_1_one_apart() -> None:
    queues = RequestQueues()
    admission = Admission(
        queues,
        PageTable(PagePool(16), 4),
        AuxPool(4),
        lambda: 0.0,
        chunk_size=4,
        max_batch_tokens=4,
        max_running_requests=4,
    )
    req = request("a", 12)
    queues.add(req)
    queues.move(req, RequestState.WAITING)
    ids = []
    while (batch := admission.next_batch()) is not None:
        ids.append(batch.plan.batch_id)
    assert ids == [1, 2, 3]


def test_a_chunk_starts_on_a_page_inside_its_prompt() -> None:
    with pytest.raises(AssertionError):
        chunk_end(8, 8, 4, 4)  # the prompt is done
    with pytest.raises(AssertionError):
        chunk_end(2, 8, 4, 4)  # not on a page boundary


def test_a_request_is_added_once() -> None:
    queues = RequestQueues()
    queues.add(request("a", 4))
    with pytest.raises(AssertionError):
        queues.add(request("a", 4))


def test_without_a_way_to_make_room_a_request_that_does_not_fit_waits() -> None:
    queues = RequestQueues()
    admission = Admission(
        queues,
        PageTable(PagePool(2), 4),
        AuxPool(4),
        lambda: 0.0,
        chunk_size=4,
        max_batch_tokens=4,
        max_running_requests=4,
    )
    req = request("a", 12)  # 3 pages of a pool of 2 (its prefix cache makes no room)
    queues.add(req)
    queues.move(req, RequestState.WAITING)
    assert admission.next_batch() is None and req.state is RequestState.WAITING


def test_a_budget_of_one_token_still_continues_a_prefill() -> None:
    queues = RequestQueues()
    admission = Admission(
        queues,
        PageTable(PagePool(16), 1),
        AuxPool(4),
        lambda: 0.0,
        chunk_size=4,
        max_batch_tokens=5,
        max_running_requests=4,
    )
    for request_id in ("a", "b"):
        req = request(request_id, 8)
        queues.add(req)
        queues.move(req, RequestState.WAITING)
    first, second = admission.next_batch(), admission.next_batch()
    assert first is not None and second is not None
    assert [(c.request_id, c.num_tokens) for c in first.plan.chunks] == [("a", 4), ("b", 1)]
    assert [(c.request_id, c.num_tokens) for c in second.plan.chunks] == [("a", 4), ("b", 1)]


def test_a_request_waits_for_its_want_unless_given_optimistic_attempts() -> None:
    queues = RequestQueues()
    unclaimed, optimistic = request("a", 4), request("b", 4)
    optimistic.attempts_left = 1  # what Handoff.on_submit gives with optimistic prefill on
    queues.add(unclaimed)
    assert queues.head_waiting() is queues.head_speculative() is None  # not before its want
    queues.add(optimistic)
    assert queues.head_waiting() is None  # the claimed requests' queue
    assert queues.head_speculative() is optimistic
