"""A tracked request from arrival: what it starts with, the outcome it gives at each phase
(timings of phases not reached are 0, the current one runs until now), and that a failed
request never reports a first token (found unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

from prefill_worker.request import (
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    SamplingParams,
    Timings,
    TransferStats,
)
from prefill_worker.scheduler.tracked import Request


def arrived() -> Request:
    message = PrefillRequest("r", [1, 2, 3], SamplingParams(), False, 77, 10.0, None, "decode-1")
    return Request(message, None)


def test_a_new_request_holds_nothing_and_knows_its_room_and_peer() -> None:
    req = arrived()
    assert (req.room, req.decode_peer) == (77, "decode-1")
    assert (req.num_computed_tokens, req.num_scheduled_tokens, req.num_cached_tokens) == (0, 0, 0)
    assert (req.num_prefix_hit_tokens, req.page_ids, req.aux_row) == (0, (), None)
    assert req.is_in_forward is False
    assert (req.first_token_id, req.first_token_logprob, req.finish_time) == (None, None, None)


def test_an_outcome_before_any_work_is_all_zero_but_the_bootstrap_time() -> None:
    outcome = arrived().outcome(FinishReason.ABORTED_BY_ROUTER, None, now=10.25)
    assert outcome == Outcome(
        request_id="r",
        status=OutcomeStatus.ABORTED,
        reason=FinishReason.ABORTED_BY_ROUTER,
        num_prompt_tokens=3,
        timings=Timings(bootstrap_s=0.25),
    )


def test_each_phase_runs_until_the_next_mark_or_now() -> None:
    req = arrived()
    req.ready_time = 10.25
    assert req.timings(10.5) == Timings(bootstrap_s=0.25, queue_s=0.25)
    req.prefill_start_time = 10.5
    assert req.timings(10.75) == Timings(bootstrap_s=0.25, queue_s=0.25, prefill_s=0.25)
    req.prefill_end_time, req.finish_time = 10.75, 11.0
    assert req.timings(99.0) == Timings(0.25, 0.25, 0.25, 0.25)


def test_a_failed_request_reports_no_first_token() -> None:
    req = arrived()
    req.first_token_id, req.first_token_logprob = 5, -0.5
    failed = req.outcome(FinishReason.TRANSFER_FAILED, "lost", now=11.0)
    assert (failed.first_token_id, failed.first_token_logprob) == (None, None)
    ok = req.outcome(FinishReason.OK, None, now=11.0)
    assert (ok.first_token_id, ok.first_token_logprob, ok.transfer) == (5, -0.5, TransferStats())
