"""Random arrivals, prompt lengths, chunking, aborts, handshakes and transfer failures, with
the prefix cache on or off and prompts that often start like an earlier one.

Optimistic prefill on or off: with it on, requests prefill before their want, are held, and
yield and are requeued (each success took one more attempt than its ``prefill_retries``).
After every turn the engine's bookkeeping must be consistent; after every run: pools whole,
exactly one outcome per request, non-final chunks page-aligned, and the pages sent for each
successful prompt cover it exactly once, with the right first token (read back from pages a
hit may have shared), and computed plus cache-hit tokens make the prompt. Prompts asking for
prompt logprobs get one per token after their start, from a hit no longer than the start.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from prefill_worker.kv.tables import num_pages_for
from prefill_worker.request import FinishReason, OutcomeStatus
from prefill_worker.transfer.base import KVPoll
from tests.unit.scheduler.fakes import Rig, expected_token, fake_logprob, make_rig

ARRIVE = st.tuples(
    st.just("arrive"),
    st.integers(1, 48),  # prompt tokens (some exceed small pools)
    st.sampled_from([True, True, False]),  # the decode side's `want` comes at once
    st.sampled_from([None, None, None, 2.0, 6.0]),  # deadline_s
    st.one_of(st.none(), st.integers(0, 50), st.integers(0, 50)),  # starts like this earlier one
    st.one_of(st.none(), st.none(), st.integers(0, 50)),  # prompt logprobs from (clipped to n)
)
REPEAT = st.tuples(  # + extra tokens, and prompt logprobs from (clipped to n)
    st.just("repeat"),
    st.integers(0, 50),
    st.integers(0, 9),
    st.one_of(st.none(), st.integers(0, 60)),
)
EVENTS = st.one_of(
    ARRIVE,
    ARRIVE,
    ARRIVE,
    REPEAT,
    st.tuples(st.just("want"), st.integers(0, 50), st.integers(0, 3)),  # cached pages
    st.tuples(st.sampled_from(["abort", "decode_abort", "break", "stall"]), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    st.tuples(st.just("steps"), st.integers(1, 12)),
)


@st.composite
def configs(draw: st.DrawFn) -> dict:
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunk_size = page_size * draw(st.integers(1, 5)) + draw(st.integers(0, page_size - 1))
    return dict(
        page_size=page_size,
        chunk_size=chunk_size,
        max_batch_tokens=draw(st.integers(page_size, 3 * chunk_size)),
        num_pages=draw(st.integers(max(2, 12 // page_size), 96 // page_size)),
        num_aux_rows=draw(st.integers(1, 6)),
        max_running_requests=draw(st.integers(1, 4)),
        overlap=draw(st.booleans()),
        prefix_cache=draw(st.sampled_from([True, True, False])),
        bootstrap_timeout_s=5.0,
        transfer_timeout_s=4.0,
        auto_want=False,
        polls_to_success=draw(st.integers(0, 3)),
        optimistic=draw(st.booleans()),
        optimistic_attempts=draw(st.integers(1, 2)),
        optimistic_hold_s=draw(st.sampled_from([0.5, 2.0])),
    )


def apply(rig: Rig, event: tuple, ids: list[str]) -> None:
    kind = event[0]
    if kind == "arrive":
        request_id = f"r{len(ids)}"
        fresh = [(7919 * len(ids) + 13 * i) % 50000 for i in range(event[1])]
        if event[4] is not None and ids:
            earlier = rig.messages[ids[event[4] % len(ids)]].token_ids
            fresh[: len(earlier)] = earlier[: len(fresh)]
        ids.append(request_id)
        start = None if event[5] is None else min(event[5], len(fresh))
        rig.prefill(request_id, 0, token_ids=fresh, deadline_s=event[3], prompt_logprob_start=start)
        if event[2]:
            rig.sender(request_id).want()
        return
    if kind == "repeat" and ids:  # an earlier prompt again, maybe longer: a multi-turn chat
        earlier = rig.messages[ids[event[1] % len(ids)]].token_ids
        request_id = f"r{len(ids)}"
        ids.append(request_id)
        tokens = [*earlier, *[(104729 * len(ids) + i) % 50000 for i in range(event[2])]]
        start = None if event[3] is None else min(event[3], len(tokens))
        rig.prefill(request_id, 0, token_ids=tokens, prompt_logprob_start=start)
        rig.sender(request_id).want()
        return
    if kind == "tick":
        rig.clock.advance(event[1])
        return
    if kind == "steps":
        for _ in range(event[1]):
            rig.engine.step()
            rig.engine.check_integrity()
        return
    if not ids:
        return
    request_id = ids[event[1] % len(ids)]
    sender = rig.sender(request_id)
    if kind == "want" and sender.state is KVPoll.BOOTSTRAPPING:
        sender.want(event[2] * rig.page_size)
    elif kind == "abort":
        rig.abort(request_id)
    elif kind == "decode_abort" and not sender.is_closed:
        sender.decode_abort()
    elif kind == "break" and not sender.is_closed:
        sender.break_()
    elif kind == "stall":
        sender.polls_to_success = None


def check_plans(rig: Rig, config: dict) -> None:
    """Each attempt's chunks follow on from its hit; a new attempt comes only after a whole
    prefill (an optimistic one that yielded), and a success took one more than its retries."""
    progress: dict[str, int] = {}
    first_start: dict[str, int] = {}
    attempts: Counter[str] = Counter()
    for plan in rig.runner.plans:
        assert plan.num_tokens <= config["max_batch_tokens"]
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        for chunk in plan.chunks:
            request_id, n = chunk.request_id, len(rig.messages[chunk.request_id].token_ids)
            assert 0 < chunk.num_tokens <= config["chunk_size"]
            if progress.get(request_id, n) == n:  # a new attempt, from its hit
                attempts[request_id] += 1
                first_start[request_id] = chunk.start
                assert chunk.start % rig.page_size == 0
            else:
                assert chunk.start == progress[request_id]
            progress[request_id] = chunk.end
            is_final = chunk.end == n
            assert (chunk.sampling is not None) == is_final
            if not is_final:
                assert chunk.end % rig.page_size == 0
    for out in rig.outcomes:
        if out.status is OutcomeStatus.OK:
            assert first_start[out.request_id] == out.num_prefix_hit_tokens
            assert attempts[out.request_id] == out.prefill_retries + 1
        if not config["optimistic"]:
            assert out.prefill_retries == 0


def check_outcomes(rig: Rig, ids: list[str], config: dict) -> None:
    assert Counter(o.request_id for o in rig.outcomes) == Counter(ids)
    for out in rig.outcomes:
        msg, sender = rig.messages[out.request_id], rig.sender(out.request_id)
        too_long = num_pages_for(len(msg.token_ids), rig.page_size) > config["num_pages"]
        assert (out.reason is FinishReason.PROMPT_TOO_LONG) == too_long
        assert out.status is out.reason.status and (out.error is None) == (out.status.value == "ok")
        if out.status is not OutcomeStatus.OK:
            assert out.first_token_id is None
            if out.reason is not FinishReason.ABORTED_BY_DECODE:
                assert sender.failure_reason() is not None  # the decode side was told
            continue
        pages = num_pages_for(len(msg.token_ids), rig.page_size)
        assert sender.prompt_pages_sent() == list(range(pages))
        assert out.first_token_id == expected_token(msg.token_ids)
        assert [row.first_token_id for row in sender.aux] == [out.first_token_id]
        assert out.num_cached_tokens == sender.cached
        assert out.num_computed_tokens + out.num_prefix_hit_tokens == len(msg.token_ids)
        assert out.num_computed_tokens >= 1 and out.num_prefix_hit_tokens % rig.page_size == 0
        if not config["prefix_cache"]:
            assert out.num_prefix_hit_tokens == 0
        start, tokens = msg.prompt_logprob_start, list(msg.token_ids)
        if start is None:
            assert out.prompt_logprobs is None
            continue
        assert out.num_prefix_hit_tokens <= start  # those positions' logits were computed
        scored = tuple(fake_logprob(p, tokens[p + 1]) for p in range(start, len(tokens) - 1))
        assert out.prompt_logprobs == scored


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(configs(), st.lists(EVENTS, min_size=4, max_size=50))
def test_random_runs_keep_every_invariant(config: dict, events: list[tuple]) -> None:
    rig = make_rig(**config)
    ids: list[str] = []
    try:
        for event in events:
            apply(rig, event, ids)
        # Enough turns for the work: with one token per step every prompt token is a turn.
        num_turns = 400 + sum(len(m.token_ids) for m in rig.messages.values())
        for _ in range(num_turns):
            rig.clock.advance(0.5)
            busy = rig.engine.step()
            rig.engine.check_integrity()
            if not busy and rig.engine.load.num_live == 0:
                break
        assert rig.engine.load.num_live == 0
    finally:
        rig.engine.shutdown()
    note_event(f"prefix hits: {sum(o.num_prefix_hit_tokens > 0 for o in rig.outcomes) > 0}")
    note_event(f"prompt logprobs: {any(o.prompt_logprobs for o in rig.outcomes)}")
    note_event(f"optimistic retries: {any(o.prefill_retries for o in rig.outcomes)}")
    rig.check_whole()
    check_plans(rig, config)
    check_outcomes(rig, ids, config)
