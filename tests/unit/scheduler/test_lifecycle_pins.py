"""Each request's way from ``submit`` to its outcome, pinned through ``Engine``'s public calls
(issue #31: ``RequestLifecycle``'s surviving mutants): the sender it is given, the error an
abort carries, the head of the queue checked before admission, the first token's logprob in
the aux row, the outcome counts, a failing prefix-hit push, and what the log says."""

from __future__ import annotations

import logging
import math

import pytest

from prefill_worker.request import AbortRequest, FinishReason
from tests.unit.scheduler.fakes import make_rig

_TURN_POLLS = 32  # bootstrapping/waiting senders polled per turn, round-robin


def test_the_sender_is_made_for_the_request_room_and_prompt() -> None:
    rig = make_rig(auto_want=False)
    msg = rig.prefill("a", 10, bootstrap_room=4242)
    sender = rig.sender("a")
    assert (sender.room, sender.request_id, sender.num_tokens) == (4242, "a", 10)
    assert len(msg.token_ids) == 10
    rig.abort("a")
    rig.check_whole()


@pytest.mark.parametrize(
    ("reason", "error"),
    [
        (FinishReason.ABORTED_BY_ROUTER, "aborted by the router"),
        (FinishReason.ROUTER_GONE, "the router's connection closed"),
        (FinishReason.DRAINING, FinishReason.DRAINING.value),  # any other: its name
    ],
)
def test_an_abort_ends_the_request_with_its_reason_and_error(
    reason: FinishReason, error: str
) -> None:
    rig = make_rig(auto_want=False)
    rig.prefill("a", 8)
    rig.engine.submit(AbortRequest("a", reason))
    outcome = rig.outcome("a")
    assert (outcome.reason, outcome.error) == (reason, error)
    assert rig.sender("a").worker_failure == error
    rig.check_whole()


def test_the_head_of_the_waiting_queue_is_checked_before_admission() -> None:
    # Over 32 rooms wait for their decode peers, so a turn's round-robin poll misses some;
    # the request admission would take next is polled every turn all the same: its decode
    # aborted, it ends before it reaches a forward.
    rig = make_rig(auto_want=False, max_running_requests=1, chunk_size=4, max_batch_tokens=4)
    rig.prefill("big", 64)  # prefills for 16 turns, alone (one running request at most)
    rig.prefill("next", 4)
    for i in range(2 * _TURN_POLLS):
        rig.prefill(f"idle{i}", 4)  # their decode peers never ask
    rig.sender("big").want()
    rig.sender("next").want()
    rig.steps(1)  # polled both: big prefills, next waits at the head
    assert rig.engine.load.num_waiting == 1
    rig.sender("next").decode_abort()
    rig.steps(1)  # this turn's round-robin is 32 idle rooms: only the head check sees it
    assert rig.outcome("next").reason is FinishReason.ABORTED_BY_DECODE
    assert all(chunk.request_id != "next" for p in rig.runner.plans for chunk in p.chunks)
    rig.engine.shutdown()
    rig.check_whole()


@pytest.mark.parametrize("return_logprob", [True, False])
def test_the_aux_row_carries_the_first_token_logprob_when_asked(return_logprob: bool) -> None:
    rig = make_rig()
    rig.prefill("a", 8, return_logprob=return_logprob)
    rig.run_until_idle()
    [row] = rig.sender("a").aux
    if return_logprob:
        assert row.first_token_logprob == -0.5  # FakeRunner's sampled logprob
        assert rig.outcome("a").first_token_logprob == -0.5
    else:
        assert math.isnan(row.first_token_logprob)
    rig.check_whole()


def test_outcome_counts_count_every_outcome() -> None:
    rig = make_rig()
    for name in ("a", "b", "c"):
        rig.prefill(name, 8)
    rig.abort("c")
    rig.run_until_idle()
    assert dict(rig.engine.outcome_counts) == {
        FinishReason.OK: 2,
        FinishReason.ABORTED_BY_ROUTER: 1,
    }
    rig.check_whole()


def test_a_prefix_hit_push_that_raises_fails_only_its_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(prefix_cache=True)
    first = rig.prefill("a", 16)
    rig.run_until_idle()
    rig.prefill("b", 20, token_ids=[*first.token_ids, 1, 2, 3, 4])  # 16 tokens cached
    rig.prefill("c", 8)
    rig.sender("b").send_raises = RuntimeError("peer buffer gone")
    with caplog.at_level(logging.ERROR):
        rig.run_until_idle()
    assert rig.outcome("b").reason is FinishReason.ENGINE_ERROR
    assert "peer buffer gone" in (rig.outcome("b").error or "")
    assert rig.outcome("c").reason is FinishReason.OK
    assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("request b failed while its batch was handled", True)
    ]
    rig.check_whole()


def test_a_sender_whose_poll_raises_fails_its_request_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(auto_want=False)
    rig.prefill("a", 8)
    rig.prefill("b", 8)
    rig.sender("a").poll_raises = OSError("socket closed")
    rig.sender("b").want()
    with caplog.at_level(logging.ERROR):
        rig.run_until_idle()
    assert rig.outcome("a").reason is FinishReason.ENGINE_ERROR
    assert rig.outcome("b").reason is FinishReason.OK
    assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("request a: its sender failed", True)
    ]
    rig.check_whole()


def test_a_prompt_logprob_start_beyond_the_prompt_is_refused_before_anything_is_made() -> None:
    # The ingress refuses such a message; the engine trusts it, and asserts that trust.
    rig = make_rig()
    with pytest.raises(AssertionError, match="'a': 9"):
        rig.prefill("a", 8, prompt_logprob_start=9)
    assert not rig.backend.all_senders
    rig.prefill("b", 8, prompt_logprob_start=8)  # the prompt's end: nothing to score
    rig.run_until_idle()
    assert rig.outcome("b").reason is FinishReason.OK
    rig.check_whole()


def test_a_bootstrap_timeout_carries_the_sender_hint_on_why_no_handshake_came() -> None:
    rig = make_rig(auto_want=False, bootstrap_timeout_s=5.0)
    rig.prefill("a", 8)
    rig.prefill("b", 8)
    hint = "no decode peer connected to this worker"
    rig.sender("a").why_no_handshake = lambda: hint  # type: ignore[method-assign]
    rig.clock.advance(5.0)
    rig.steps(1)
    within = "no handshake from the decode peer within 5.0s"
    assert rig.outcome("a").error == f"{within}; {hint}"
    assert rig.outcome("b").error == within  # no hint: the text alone
    rig.check_whole()


def test_a_one_token_prefix_hit_is_pushed_too() -> None:
    # Pages of one token: a prompt that shares only its first token with a cached one hits
    # one page, and that page is pushed before the rest is computed.
    rig = make_rig(page_size=1, chunk_size=4, prefix_cache=True)
    first = rig.prefill("a", 4)
    rig.run_until_idle()
    rig.prefill("b", 4, token_ids=[first.token_ids[0], 7, 8, 9])
    rig.steps(1)  # b's forward launched: its cached page goes at once
    assert rig.sender("b").sent[0] == ((rig.sender("a").sent[0][0][0],), 0)
    rig.run_until_idle()
    assert rig.outcome("b").reason is FinishReason.OK
    assert sorted(rig.sender("b").prompt_pages_sent()) == [0, 1, 2, 3]
    rig.check_whole()
