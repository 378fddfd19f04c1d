"""Request: every edge of the state table, the one move method, phase timings, chunk ends."""

from __future__ import annotations

import itertools

import pytest

from prefill_worker.request import (
    ALLOWED_EDGES,
    FinishReason,
    IllegalTransition,
    OutcomeStatus,
    PrefillRequest,
    RequestState,
    SamplingParams,
    end_state,
)
from prefill_worker.scheduler.chunking import chunk_end
from prefill_worker.scheduler.tracked import Request

S = RequestState


def make_request(state: RequestState = S.BOOTSTRAPPING) -> Request:
    msg = PrefillRequest("r", [1, 2, 3], SamplingParams(), False, 7, arrival_time=100.0)
    req = Request(msg, None)
    req.state = state
    return req


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)))
def test_move_to_allows_exactly_the_table(src: RequestState, dst: RequestState) -> None:
    req = make_request(src)
    if (src, dst) in ALLOWED_EDGES:
        req.move_to(dst)
        assert req.state is dst
    else:
        with pytest.raises(IllegalTransition):
            req.move_to(dst)
        assert req.state is src


def test_the_table_is_the_designed_one() -> None:
    forward = {(S.BOOTSTRAPPING, S.WAITING), (S.WAITING, S.PREFILLING)}
    forward |= {(S.PREFILLING, S.TRANSFERRING), (S.TRANSFERRING, S.DONE)}
    forward |= {(S.BOOTSTRAPPING, S.PREFILLING), (S.PREFILLING, S.BOOTSTRAPPING)}  # optimistic
    live = [S.BOOTSTRAPPING, S.WAITING, S.PREFILLING, S.TRANSFERRING]
    ends = {(state, end) for state in live for end in (S.FAILED, S.ABORTED)}
    assert forward | ends == ALLOWED_EDGES
    assert all(not any(src is t for src, _ in ALLOWED_EDGES) for t in S if t.is_terminal)


def test_reasons_map_to_status_and_end_state() -> None:
    assert FinishReason.OK.status is OutcomeStatus.OK and end_state(FinishReason.OK) is S.DONE
    for reason in (FinishReason.ABORTED_BY_ROUTER, FinishReason.ABORTED_BY_DECODE):
        assert reason.status is OutcomeStatus.ABORTED and end_state(reason) is S.ABORTED
    assert end_state(FinishReason.BOOTSTRAP_TIMEOUT) is S.FAILED


def test_timings_split_phases_and_stop_at_the_current_one() -> None:
    req = make_request()
    assert req.timings(103.0).bootstrap_s == 3.0
    req.ready_time, req.prefill_start_time = 101.0, 104.0
    t = req.timings(106.0)
    assert (t.bootstrap_s, t.queue_s, t.prefill_s, t.transfer_s) == (1.0, 3.0, 2.0, 0.0)
    req.prefill_end_time, req.finish_time = 107.0, 110.0
    t = req.timings(999.0)
    assert (t.bootstrap_s, t.queue_s, t.prefill_s, t.transfer_s) == (1.0, 3.0, 3.0, 3.0)


def test_timings_of_an_optimistic_prefill_add_up_to_the_total() -> None:
    """Prefilled before the want (at 105): the phases run one after another from it."""
    req = make_request()  # arrived at 100
    req.prefill_start_time = 101.0
    t = req.timings(104.0)
    assert (t.bootstrap_s, t.queue_s, t.prefill_s, t.transfer_s) == (4.0, 0.0, 0.0, 0.0)
    req.prefill_end_time, req.ready_time, req.finish_time = 103.0, 105.0, 106.0
    t = req.timings(999.0)
    assert (t.bootstrap_s, t.queue_s, t.prefill_s, t.transfer_s) == (5.0, 0.0, 0.0, 1.0)


@pytest.mark.parametrize(
    "start,num_tokens,limit,page_size,end",
    [
        (0, 100, 40, 16, 32),  # non-final: down to a page boundary
        (96, 100, 40, 16, 100),  # final: whatever is left
        (0, 10, 16, 16, 10),  # short prompt: one final chunk
        (0, 100, 15, 16, None),  # budget below one page and not final: nothing
        (0, 12, 12, 16, 12),  # ...unless it finishes the prompt
        (32, 64, 32, 16, 64),
    ],
)
def test_chunk_end(
    start: int, num_tokens: int, limit: int, page_size: int, end: int | None
) -> None:
    assert chunk_end(start, num_tokens, limit, page_size) == end
