"""The engine with a fake runner and sender: life cycle, aborts, deadlines, pools, chunks."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

import pytest

from prefill_worker.batch import BatchPlan
from prefill_worker.inbox import Inbox
from prefill_worker.load import CostSignals, LoadSnapshot
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    RequestState,
    SamplingParams,
    TraceContext,
)
from prefill_worker.scheduler import Engine
from prefill_worker.transfer.base import KVPoll
from tests.unit.scheduler.fakes import Rig, expected_token, make_rig

LIVE = ("bootstrapping", "waiting", "prefilling", "transferring")


def state_of(rig: Rig) -> str | None:
    """The one live request's state, read from the load snapshot."""
    sizes = rig.engine.load.queue_sizes()
    live = [state for state, n in sizes.items() if n]
    assert sum(sizes.values()) <= 1
    return live[0] if live else None


def drive_to(rig: Rig, request_id: str, state: str, num_tokens: int = 40, **kw: object) -> None:
    """Submit one request and stop once it is in ``state``; long prompts stay prefilling.

    For WAITING, a "blocker" request holds every page first (finish it with ``unblock``).
    """
    rig.backend.auto_want = False
    rig.backend.polls_to_success = None
    if state == "waiting":
        rig.prefill("blocker", rig.pool.num_pages * rig.page_size)
        rig.sender("blocker").want()
        for _ in range(100):
            rig.engine.step()
        assert rig.engine.load.num_free_pages == 0
    rig.prefill(request_id, num_tokens, **kw)
    if state == "bootstrapping":
        return
    rig.sender(request_id).want()
    for _ in range(20):
        rig.engine.step()
        if _state(rig, request_id) == state:
            return
    raise AssertionError(f"never reached {state}: {rig.engine.load}")


def _state(rig: Rig, request_id: str) -> str | None:
    """The request's state as the load shows it, the blocker (if any) discounted."""
    sizes = rig.engine.load.queue_sizes()
    if "blocker" in rig.messages and not any(o.request_id == "blocker" for o in rig.outcomes):
        sizes["transferring"] -= 1
    live = [s for s, n in sizes.items() if n]
    return live[0] if live else None


def unblock(rig: Rig) -> None:
    if "blocker" in rig.messages:
        rig.abort("blocker")


class Recorder:
    """An ``EngineObserver`` that keeps everything it is told."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.steps: list[tuple[float, int]] = []
        self.loads: list[LoadSnapshot] = []
        self.moves: list[tuple[str, str]] = []
        self.lookups: list[tuple[int, int]] = []
        self.forwards: list[tuple[list[tuple[str, int, int]], float, float]] = []

    def on_outcome(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def on_step(self, duration_s: float, num_batch_tokens: int) -> None:
        self.steps.append((duration_s, num_batch_tokens))

    def on_load(self, load: LoadSnapshot) -> None:
        self.loads.append(load)

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        chunks = [(c.request_id, c.start, c.end) for c in plan.chunks]
        self.forwards.append((chunks, started_at, ended_at))

    def on_transition(self, request_id: str, src: RequestState, dst: RequestState) -> None:
        self.moves.append((src.value, dst.value))

    def on_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.lookups.append((num_query_tokens, num_hit_tokens))


@pytest.mark.parametrize("overlap", [False, True])
def test_happy_path_walks_every_forward_edge(overlap: bool) -> None:
    recorder = Recorder()
    rig = make_rig(overlap=overlap, auto_want=False, polls_to_success=1, observer=recorder)
    rig.prefill("a", 40)
    rig.clock.advance(1.0)
    rig.engine.step()
    assert state_of(rig) == "bootstrapping"
    rig.sender("a").want(num_cached_tokens=8)
    seen = []
    for _ in range(20):
        rig.clock.advance(1.0)
        rig.engine.step()
        seen.append(state_of(rig))
    assert recorder.moves == list(zip([*LIVE], [*LIVE[1:], "done"], strict=True))
    assert [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]] == [*LIVE[2:], None]
    out = rig.outcome("a")
    assert (out.status, out.reason, out.error) == (OutcomeStatus.OK, FinishReason.OK, None)
    assert out.first_token_id == expected_token(rig.messages["a"].token_ids)
    assert out.first_token_logprob == -0.5 and out.num_cached_tokens == 8
    assert out.num_prompt_tokens == 40
    assert out.num_computed_tokens == 40 and out.num_prefix_hit_tokens == 0
    assert recorder.lookups == [(0, 0)]  # admitted once; the cache is off: nothing looked up
    t = out.timings
    assert t.bootstrap_s >= 1 and t.queue_s >= 0 and t.prefill_s >= 1 and t.transfer_s >= 1
    sender = rig.sender("a")
    assert sender.prompt_pages_sent() == list(range(10))
    assert sender.aux[0].first_token_id == out.first_token_id
    assert sender.aux[0].num_cached_tokens == 8 and sender.aux[0].num_prompt_tokens == 40
    assert sender.aux[0].num_computed_tokens == 40
    assert sender.worker_failure is None
    rig.check_whole()
    assert rig.engine.outcome_counts[FinishReason.OK] == 1
    rig.engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_each_forward_is_told_with_its_chunks_and_when_it_ran(overlap: bool) -> None:
    """What request traces draw their chunk spans from: every collected forward, its chunks
    and the clock's reading when the runner started and returned (10 ms a token here)."""
    recorder = Recorder()
    rig = make_rig(overlap=overlap, chunk_size=16, max_batch_tokens=32, observer=recorder)
    rig.runner.on_run = lambda plan: rig.clock.advance(0.01 * plan.num_tokens)
    rig.prefill("a", 40)
    rig.prefill("b", 8)
    rig.run_until_idle()
    chunks = [c for chunks, _, _ in recorder.forwards for c in chunks]
    assert sorted(chunks) == [("a", 0, 16), ("a", 16, 32), ("a", 32, 40), ("b", 0, 8)]
    for batch, started, ended in recorder.forwards:
        tokens = sum(end - start for _, start, end in batch)
        assert ended - started == pytest.approx(0.01 * tokens)
    for (_, _, ended), (_, started, _) in itertools.pairwise(recorder.forwards):
        assert started >= ended  # one forward at a time, in order
    assert rig.outcome("a").status is OutcomeStatus.OK


def test_logprob_not_asked_for_is_nan_in_aux_and_none_in_outcome() -> None:
    rig = make_rig()
    rig.prefill("a", 5, return_logprob=False)
    rig.run_until_idle()
    assert rig.outcome("a").first_token_logprob is None
    assert math.isnan(rig.sender("a").aux[0].first_token_logprob)


@pytest.mark.parametrize("state", LIVE)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    ("reason", "error"),
    [
        (FinishReason.ABORTED_BY_ROUTER, "aborted by the router"),
        (FinishReason.ROUTER_GONE, "the router's connection closed"),
    ],
)
def test_router_abort_in_every_state(
    state: str, overlap: bool, reason: FinishReason, error: str
) -> None:
    rig = make_rig(overlap=overlap, chunk_size=8, max_batch_tokens=8, num_pages=16)
    drive_to(rig, "a", state)
    rig.engine.submit(AbortRequest("a", reason))
    out = rig.outcome("a")
    assert (out.status, out.reason) == (OutcomeStatus.ABORTED, reason)
    assert out.first_token_id is None
    assert rig.sender("a").worker_failure == error  # the decode side is told
    rig.abort("a")  # idempotent
    rig.abort("never-seen")
    unblock(rig)
    rig.run_until_idle()
    assert [o.request_id for o in rig.outcomes if o.request_id != "blocker"] == ["a"]
    rig.check_whole()
    rig.engine.shutdown()


@pytest.mark.parametrize("state", LIVE)
def test_decode_abort_in_every_state(state: str) -> None:
    rig = make_rig(chunk_size=8, max_batch_tokens=8, num_pages=16)
    drive_to(rig, "a", state)
    rig.sender("a").decode_abort()
    rig.engine.step()
    unblock(rig)
    rig.run_until_idle()
    out = rig.outcome("a")
    assert (out.status, out.reason) == (OutcomeStatus.ABORTED, FinishReason.ABORTED_BY_DECODE)
    assert rig.sender("a").worker_failure is None  # the decode side knows already
    rig.check_whole()


@pytest.mark.parametrize(
    ("poll", "reason"),
    [(KVPoll.FAILED, FinishReason.TRANSFER_FAILED), (KVPoll.PEER_LOST, FinishReason.PEER_LOST)],
)
@pytest.mark.parametrize("state", LIVE)
def test_sender_failure_in_every_state(state: str, poll: KVPoll, reason: FinishReason) -> None:
    rig = make_rig(chunk_size=8, max_batch_tokens=8, num_pages=16)
    drive_to(rig, "a", state)
    rig.sender("a").break_("decode peer silent for over 3 s", poll)
    rig.engine.step()
    unblock(rig)
    rig.run_until_idle()
    out = rig.outcome("a")
    assert (out.status, out.reason) == (OutcomeStatus.FAILED, reason)
    assert out.error == "decode peer silent for over 3 s"
    rig.check_whole()


def test_bootstrap_timeout_says_the_decode_peer_never_came() -> None:
    rig = make_rig(auto_want=False, bootstrap_timeout_s=5.0)
    rig.prefill("a", 8)
    rig.clock.advance(4.9)
    rig.steps(3)
    assert rig.outcomes == []
    rig.clock.advance(0.2)
    rig.engine.step()
    out = rig.outcome("a")
    assert out.reason is FinishReason.BOOTSTRAP_TIMEOUT
    assert out.error == "no handshake from the decode peer within 5.0s"  # no room: it is logged
    assert rig.sender("a").worker_failure is not None
    rig.check_whole()


def test_bootstrap_deadline_no_longer_applies_after_the_handshake() -> None:
    rig = make_rig(bootstrap_timeout_s=5.0, polls_to_success=None, transfer_timeout_s=60.0)
    rig.prefill("a", 8)
    rig.steps(5)
    rig.clock.advance(10.0)
    rig.steps(2)
    assert rig.outcomes == [] and state_of(rig) == "transferring"


def test_transfer_timeout_counts_from_the_end_of_prefill() -> None:
    rig = make_rig(polls_to_success=None, transfer_timeout_s=3.0, bootstrap_timeout_s=1.0)
    rig.prefill("a", 8)
    rig.clock.advance(0.5)
    rig.steps(3)
    assert state_of(rig) == "transferring"
    rig.clock.advance(2.9)
    rig.steps(2)
    assert rig.outcomes == []
    rig.clock.advance(0.2)
    rig.engine.step()
    out = rig.outcome("a")
    assert out.reason is FinishReason.TRANSFER_TIMEOUT and out.status is OutcomeStatus.FAILED
    assert out.error == "KV transfer did not finish within 3.0s"
    rig.check_whole()


@pytest.mark.parametrize("state", LIVE)
def test_request_deadline_in_every_state(state: str) -> None:
    rig = make_rig(chunk_size=8, max_batch_tokens=8, num_pages=16, bootstrap_timeout_s=100.0)
    drive_to(rig, "a", state, deadline_s=2.0)
    rig.clock.advance(2.5)
    rig.engine.step()
    out = rig.outcome("a")
    assert out.reason is FinishReason.DEADLINE_EXCEEDED and state in (out.error or "")
    unblock(rig)
    rig.run_until_idle()
    rig.check_whole()


def test_prompt_larger_than_the_pool_fails_at_once() -> None:
    rig = make_rig(num_pages=4, page_size=4)
    rig.prefill("big", 17)
    out = rig.outcome("big")
    assert out.reason is FinishReason.PROMPT_TOO_LONG and out.status is OutcomeStatus.FAILED
    assert out.error == "17 tokens need 5 KV pages; the pool has 4"
    rig.check_whole()


def test_pool_exhaustion_waits_fcfs_and_recovers() -> None:
    rig = make_rig(num_pages=4, page_size=4, polls_to_success=2)
    rig.prefill("a", 16)  # the whole pool
    rig.prefill("b", 8)  # must wait for a's pages
    rig.prefill("c", 2)  # would fit later, but waits behind b (FCFS)
    rig.steps(2)
    assert rig.engine.load.num_waiting == 2 and rig.engine.load.num_free_pages == 0
    rig.run_until_idle()
    assert [o.request_id for o in rig.outcomes] == ["a", "b", "c"]
    assert all(o.reason is FinishReason.OK for o in rig.outcomes)
    started = [chunk.request_id for plan in rig.runner.plans for chunk in plan.chunks]
    assert started.index("b") < started.index("c")
    rig.check_whole()


def test_aux_rows_and_running_cap_limit_admission() -> None:
    rig = make_rig(num_aux_rows=1, polls_to_success=3)
    rig.prefill("a", 4)
    rig.prefill("b", 4)
    rig.steps(2)
    assert rig.engine.load.num_free_aux_rows == 0 and rig.engine.load.num_waiting == 1
    rig.run_until_idle()
    assert {o.request_id for o in rig.outcomes} == {"a", "b"}
    rig = make_rig(max_running_requests=2, chunk_size=4, max_batch_tokens=64)
    for name in "abc":
        rig.prefill(name, 12)
    rig.steps(1)
    assert len(rig.runner.plans) == 0 or len(rig.runner.plans[0].chunks) <= 2
    rig.steps(1)
    assert [len(p.chunks) for p in rig.runner.plans][:1] == [2]
    rig.run_until_idle()
    rig.check_whole()


def test_chunks_end_on_page_boundaries_and_share_the_budget() -> None:
    rig = make_rig(page_size=16, chunk_size=40, max_batch_tokens=48, num_pages=32)
    rig.prefill("a", 100)
    rig.prefill("b", 20)
    rig.run_until_idle()
    spans = [[(c.request_id, c.start, c.end) for c in p.chunks] for p in rig.runner.plans]
    assert spans == [
        [("a", 0, 32), ("b", 0, 16)],
        [("a", 32, 64), ("b", 16, 20)],
        [("a", 64, 100)],  # 36 tokens left: one final chunk, no alignment needed
    ]
    assert rig.sender("a").sent == [((0, 1), 0), ((2, 3), 2), ((4, 5, 6), 4)]
    assert rig.outcome("a").first_token_id == expected_token(rig.messages["a"].token_ids)
    rig.check_whole()


def test_abort_during_a_running_forward_frees_pages_only_after_it() -> None:
    rig = make_rig(overlap=True, num_pages=4, page_size=4, chunk_size=4, max_batch_tokens=4)
    rig.prefill("a", 16)
    rig.runner.gate = threading.Event()
    rig.engine.step()  # plan and launch chunk 1; it blocks on the gate
    assert rig.runner.started.wait(timeout=10)
    rig.abort("a")
    assert rig.outcome("a").reason is FinishReason.ABORTED_BY_ROUTER
    assert rig.pool.num_free == 0  # the forward may still write a's pages
    rig.engine.check_integrity()
    rig.prefill("b", 4)
    rig.runner.gate.set()
    rig.run_until_idle()
    assert rig.outcome("b").reason is FinishReason.OK
    rig.check_whole()
    rig.engine.shutdown()


def test_a_drain_lets_accepted_requests_finish_and_shutdown_fails_the_rest() -> None:
    rig = make_rig(auto_want=False)
    rig.prefill("a", 8)
    rig.prefill("b", 8)
    rig.sender("a").want()
    rig.steps(5)
    assert rig.outcome("a").reason is FinishReason.OK
    assert rig.engine.load.num_live == 1
    rig.engine.shutdown()
    assert rig.outcome("b").reason is FinishReason.DRAINING
    rig.check_whole()


def test_an_empty_prompt_is_a_caller_bug() -> None:
    # The ingress owns empty prompts (it rejects them with EMPTY_PROMPT): the engine trusts it.
    rig = make_rig(auto_want=False)
    with pytest.raises(AssertionError, match="empty prompt"):
        rig.prefill("e", 0)


def test_a_live_request_id_again_is_a_caller_bug() -> None:
    # The ingress owns duplicates (it scopes ids per router connection): the engine trusts it.
    rig = make_rig(auto_want=False)
    rig.prefill("a", 8)
    with pytest.raises(AssertionError, match="'a' is live"):
        rig.prefill("a", 4)


def test_the_requests_trace_context_reaches_the_sender() -> None:
    """For the decode's trace (docs/observability.md): the request's traceparent goes to the
    sender, which puts it in its statuses."""
    rig = make_rig(auto_want=False)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    rig.prefill("traced", 8, trace_context=TraceContext(parent, "k=v"))
    rig.prefill("plain", 8)
    assert rig.sender("traced").traceparent == parent
    assert rig.sender("plain").traceparent is None
    rig.engine.shutdown()
    rig.check_whole()


def test_the_decode_peer_named_by_the_router_reaches_the_sender() -> None:
    rig = make_rig(auto_want=False)
    rig.prefill("named", 8, decode_peer="decode-7")
    rig.prefill("any", 8)
    assert rig.sender("named").allowed_peer == "decode-7"
    assert rig.sender("any").allowed_peer is None
    rig.engine.shutdown()
    rig.check_whole()


class StopWhen(threading.Event):
    """A stop flag that turns on by itself once ``condition()`` holds."""

    def __init__(self, condition: Callable[[], bool]) -> None:
        super().__init__()
        self.condition = condition

    def is_set(self) -> bool:
        return self.condition()


@pytest.mark.parametrize("overlap", [False, True])
def test_run_takes_messages_from_the_inbox_until_stopped(overlap: bool) -> None:
    rig = make_rig(overlap=overlap)
    inbox = Inbox()
    messages = [
        PrefillRequest(f"q{i}", [1, 2, 3] * (i + 1), SamplingParams(), False, i, rig.clock())
        for i in range(3)
    ]
    for message in messages:
        inbox.put(message)
    inbox.put(AbortRequest("q1"))
    rig.engine.run(StopWhen(lambda: len(rig.outcomes) == 3), inbox)
    assert {o.request_id: o.reason for o in rig.outcomes} == {
        "q0": FinishReason.OK,
        "q1": FinishReason.ABORTED_BY_ROUTER,
        "q2": FinishReason.OK,
    }
    assert inbox.empty()
    rig.engine.shutdown()
    rig.check_whole()


def test_a_runner_error_fails_everything_and_propagates() -> None:
    rig = make_rig(overlap=True, auto_want=False)
    rig.prefill("a", 8)
    rig.prefill("b", 8)
    rig.sender("a").want()
    rig.runner.fail_with = RuntimeError("device lost")
    with pytest.raises(RuntimeError, match="device lost"):
        rig.engine.run(threading.Event(), Inbox())
    assert {o.request_id: o.reason for o in rig.outcomes} == {
        "a": FinishReason.ENGINE_ERROR,
        "b": FinishReason.ENGINE_ERROR,
    }
    assert "device lost" in (rig.outcome("a").error or "")
    rig.engine.shutdown()
    rig.check_whole()


@pytest.mark.parametrize("how", ["stopped", "raised", "broken"])
def test_shutdown_answers_what_the_inbox_still_holds(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop ended (stopped, or its forward raised: a tensor-parallel group failed under
    it) with a prefill queued after its last turn: it gets its one reply, its decode hears the
    room failed, the pools are whole; a backend that cannot open its sender any more still
    lets it be answered."""
    rig = make_rig(overlap=True, auto_want=False)
    rig.prefill("a", 8)
    inbox = Inbox()
    late = PrefillRequest("late", [1, 2, 3], SamplingParams(), False, 9, rig.clock())
    if how == "raised":
        rig.sender("a").want()
        rig.runner.fail_with = RuntimeError("group failed")
        with pytest.raises(RuntimeError, match="group failed"):
            rig.engine.run(threading.Event(), inbox)
    else:
        stopped = threading.Event()
        stopped.set()
        rig.engine.run(stopped, inbox)
    if how == "broken":
        rig.backend.create_sender = _raises  # type: ignore[assignment]
    inbox.put(late)
    inbox.put(PrefillRequest("later", [4, 5], SamplingParams(), False, 10, rig.clock()))
    with caplog.at_level(logging.WARNING, logger="prefill_worker.scheduler.engine"):
        rig.engine.shutdown(FinishReason.ENGINE_ERROR, inbox)
    assert {o.request_id: o.reason for o in rig.outcomes} == {
        "a": FinishReason.ENGINE_ERROR,
        "late": FinishReason.ENGINE_ERROR,
        "later": FinishReason.ENGINE_ERROR,
    }
    late_out = rig.outcome("late")
    assert late_out.error == "the worker shut down (engine_error)"
    assert (late_out.status, late_out.num_prompt_tokens) == (OutcomeStatus.FAILED, 3)
    assert "shutdown: 2 messages the loop never took answered" in caplog.messages
    assert inbox.empty()
    if how != "broken":
        assert rig.sender("late").worker_failure and rig.sender("late").is_closed
    else:
        logged = [r.getMessage() for r in caplog.records]
        assert "a message left in the inbox could not be submitted" in logged
    rig.check_whole()


def _raises(*args: object, **kw: object) -> None:
    raise RuntimeError("the backend is gone")


def test_observer_sees_outcomes_steps_and_load_changes() -> None:
    recorder = Recorder()
    rig = make_rig(num_pages=16, page_size=4, chunk_size=8, max_batch_tokens=8, observer=recorder)
    rig.prefill("a", 12)
    rig.run_until_idle()
    assert recorder.outcomes == rig.outcomes
    assert [tokens for _, tokens in recorder.steps] == [8, 4, 0]
    assert all(duration >= 0 for duration, _ in recorder.steps)
    assert any(load.num_prefilling == 1 and load.num_used_pages == 3 for load in recorder.loads)
    shape = CostSignals(chunk_size=8, max_batch_tokens=8)  # no clock advance: no rate
    assert recorder.loads[-1] == LoadSnapshot(0, 0, 0, 0, 16, 16, 8, 8, costs=shape)
    assert all(a != b for a, b in zip(recorder.loads, recorder.loads[1:], strict=False))


def test_bad_chunking_config_is_refused() -> None:
    with pytest.raises(ValueError, match="page boundary"):
        make_rig(page_size=16, chunk_size=8)


def test_sender_poll_states_cover_the_protocol() -> None:
    terminal = {KVPoll.FAILED, KVPoll.ABORTED, KVPoll.PEER_LOST, KVPoll.SUCCESS}
    assert terminal == {p for p in KVPoll if p.is_terminal}
    assert Engine.__doc__


def test_live_requests_waiting_for_decode_do_not_spin_the_loop() -> None:
    # Eight requests wait for their decode peer: the loop sleeps on the inbox and the
    # backend (capped at 50 ms a wait) instead of polling every millisecond.
    rig = make_rig(auto_want=False, bootstrap_timeout_s=60.0)
    for i in range(8):
        rig.prefill(f"r{i}", 8)
    stop, inbox = threading.Event(), Inbox()
    thread = threading.Thread(target=rig.engine.run, args=(stop, inbox))
    thread.start()
    try:
        time.sleep(0.3)
        assert rig.backend.num_polls < 30, rig.backend.num_polls  # 1 ms polling: ~300
        before = rig.backend.num_polls
        started = time.monotonic()
        inbox.put(AbortRequest("r3"))  # wakes the loop at once, not at the end of its wait
        while not rig.outcomes and time.monotonic() - started < 5:
            time.sleep(0.001)
        assert [o.request_id for o in rig.outcomes] == ["r3"]
        assert rig.backend.num_polls > before
    finally:
        stop.set()
        inbox.wake()
        thread.join(timeout=5)
    assert not thread.is_alive()
    rig.engine.shutdown()
    rig.check_whole()


def test_the_outcome_carries_the_bytes_its_sender_wrote() -> None:
    rig = make_rig()
    rig.prefill("a", 10)  # 3 pages of 4 tokens, then the aux row
    rig.run_until_idle()
    assert rig.outcome("a").reason is FinishReason.OK
    assert rig.outcome("a").transfer.bytes == rig.sender("a").transfer_stats().bytes == 3 + 1
    rig.check_whole()


def test_aborted_requests_do_not_hold_up_the_watch_ring() -> None:
    """10,000 requests aborted while bootstrapping, then one whose decode wants it at once:
    the next turn polls it. Before, the dead entries in the ring took the poll budget (32 a
    turn) until skipped, so a new request waited ~300 turns (an HTTP batch of
    100,000 aborted prompts made ZMQ requests fail ``bootstrap_timeout`` for ~20 s)."""
    rig = make_rig(auto_want=False, bootstrap_timeout_s=60.0)
    for i in range(10_000):
        rig.prefill(f"dead{i}", 8)
    rig.engine.step()
    for i in range(10_000):
        rig.abort(f"dead{i}")
    rig.prefill("live", 8)
    rig.sender("live").want()
    rig.engine.step()
    assert state_of(rig) in ("waiting", "prefilling"), rig.engine.load
    rig.steps(50)
    assert [o.request_id for o in rig.outcomes[-1:]] == ["live"]
    rig.check_whole()
