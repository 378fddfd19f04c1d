"""The engine with its prefix cache on (fake runner and sender): hits skip compute but are
still sent, whole-prompt hits compute the last page, a request filling pages shares them only
once they are complete, decode-held and worker-held prefixes combine, and an abort in every
state with shared pages leaves the pool whole."""

from __future__ import annotations

import threading

import pytest

from prefill_worker.batch import BatchPlan
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import FinishReason, OutcomeStatus, RequestState
from tests.unit.scheduler.fakes import RecordingEvents, Rig, expected_token, make_rig

PS = 4


class States:
    """An ``EngineObserver`` that keeps each request's state and the prefix lookups."""

    def __init__(self) -> None:
        self.state: dict[str, RequestState] = {}
        self.lookups: list[tuple[int, int]] = []

    def on_outcome(self, outcome: object) -> None:
        return None

    def on_step(self, duration_s: float, num_batch_tokens: int) -> None:
        return None

    def on_load(self, load: LoadSnapshot) -> None:
        return None

    def on_forward(self, plan: BatchPlan, started_at: float, ended_at: float) -> None:
        return None

    def on_transition(self, request_id: str, src: RequestState, dst: RequestState) -> None:
        self.state[request_id] = dst

    def on_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.lookups.append((num_query_tokens, num_hit_tokens))


def cached_rig(**kw: object) -> tuple[Rig, States]:
    states = States()
    options: dict = dict(page_size=PS, chunk_size=8, max_batch_tokens=16, num_pages=48)
    options.update(kw)
    return make_rig(prefix_cache=True, observer=states, **options), states


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 50000 for i in range(n)]


def check_ok(rig: Rig, request_id: str, hit: int) -> None:
    """Right first token (read back from the pages), every page sent once, counts reported."""
    out, msg = rig.outcome(request_id), rig.messages[request_id]
    n = len(msg.token_ids)
    assert out.reason is FinishReason.OK, out
    assert out.first_token_id == expected_token(msg.token_ids)
    assert (out.num_prefix_hit_tokens, out.num_computed_tokens) == (hit, n - hit)
    sender = rig.sender(request_id)
    assert sorted(sender.prompt_pages_sent()) == list(range(-(-n // PS)))
    assert sender.aux[0].num_computed_tokens == n - hit
    assert sender.aux[0].num_prefix_hit_tokens == hit
    computed = [
        (c.start, c.end) for p in rig.runner.plans for c in p.chunks if c.request_id == request_id
    ]
    assert computed[0][0] == hit and computed[-1][1] == n  # nothing before the hit computed


@pytest.mark.parametrize("overlap", [False, True])
def test_partial_and_whole_prompt_hits(overlap: bool) -> None:
    rig, states = cached_rig(overlap=overlap)
    a = tokens(40, 1)
    for request_id, prompt, hit in (
        ("a", a, 0),
        ("partial", [*a[:26], *tokens(14, 2)], 24),  # 6 whole pages shared, then it differs
        ("whole", a, 36),  # all 10 pages cached: the last one is computed again
        ("ragged", a[:38], 36),  # 9 whole pages cached, the partial tenth computed
        ("short", a[:3], 0),  # less than a page
    ):
        rig.prefill(request_id, 0, token_ids=prompt)
        rig.run_until_idle()
        check_ok(rig, request_id, hit)
    assert states.lookups == [(40, 0), (40, 24), (40, 36), (38, 36), (3, 0)]
    assert not rig.runner.errors
    rig.check_whole()
    rig.engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_hit_on_pages_a_running_request_is_still_filling(overlap: bool) -> None:
    """``b`` shares 48 tokens with ``a`` and arrives while ``a`` prefills: it gets only the
    pages ``a`` had finished when ``b`` was admitted, computes the rest itself, and no chunk
    of either runs before its prefix is in place (the fake runner checks at each chunk)."""
    rig, states = cached_rig(overlap=overlap, chunk_size=8, max_batch_tokens=16)
    a = tokens(64, 3)
    rig.prefill("a", 0, token_ids=a)
    for _ in range(3):
        rig.engine.step()
    assert states.state["a"] is RequestState.PREFILLING
    rig.prefill("b", 0, token_ids=[*a[:48], *tokens(9, 4)])
    rig.run_until_idle()
    ((_, a_hit), (_, b_hit)) = states.lookups
    assert a_hit == 0 and 0 < b_hit < 48  # a part of a's prompt was complete, not all of it
    check_ok(rig, "a", 0)
    check_ok(rig, "b", b_hit)
    assert not rig.runner.errors
    rig.prefill("c", 0, token_ids=[*a[:48], *tokens(5, 5)])  # now all 12 shared pages are in
    rig.run_until_idle()
    check_ok(rig, "c", 48)
    rig.check_whole()
    rig.engine.shutdown()


def test_decode_held_and_worker_held_prefixes_combine() -> None:
    """The decode peer holds 8 tokens, the worker 24: 16 of 40 computed; the sender gets
    every page (it skips the decode's own), the aux row says both."""
    rig, _ = cached_rig(auto_want=False)
    a = tokens(40, 6)
    rig.prefill("a", 0, token_ids=a)
    rig.sender("a").want()
    rig.run_until_idle()
    rig.prefill("b", 0, token_ids=[*a[:24], *tokens(16, 7)])
    rig.sender("b").want(num_cached_tokens=8)
    rig.run_until_idle()
    check_ok(rig, "b", 24)
    out, aux = rig.outcome("b"), rig.sender("b").aux[0]
    assert out.num_cached_tokens == aux.num_cached_tokens == 8
    a_pages = [page_id for page_ids, _ in rig.sender("a").sent for page_id in page_ids]
    assert rig.sender("b").sent[0] == (tuple(a_pages[:6]), 0)  # the hit, sent first
    rig.check_whole()


def test_exhaustion_evicts_idle_cached_pages_lru_and_waits_for_pages_in_use() -> None:
    events = RecordingEvents()
    rig, states = cached_rig(num_pages=12, cache_events=events, polls_to_success=None)
    rig.prefill("a", 0, token_ids=tokens(16, 8))  # 4 pages, cached, stays transferring
    rig.prefill("b", 0, token_ids=tokens(16, 9))  # 4 more
    for _ in range(10):
        rig.engine.step()
    rig.sender("b").polls_to_success = 0
    rig.steps(5)
    assert "b" in {o.request_id for o in rig.outcomes}  # b done: its 4 pages idle in the cache
    assert rig.engine.load.num_free_pages == 8 and rig.engine.load.num_cached_pages == 8
    rig.prefill("c", 0, token_ids=tokens(32, 10))  # 8 pages: 4 free + b's 4 idle, not a's
    for _ in range(10):
        rig.engine.step()
    assert states.state["c"] in (RequestState.TRANSFERRING, RequestState.DONE)
    removed = [h for e in events.events if e[0] == "removed" for h in e[1]]
    assert len(removed) == 4  # b's pages; a's are in use
    rig.prefill("d", 0, token_ids=tokens(8, 11))  # 2 pages: nothing free, nothing idle
    for _ in range(5):
        rig.engine.step()
    assert states.state["d"] is RequestState.WAITING
    for sender in rig.backend.all_senders:
        sender.polls_to_success = 0
    rig.backend.polls_to_success = 0
    rig.run_until_idle()
    assert rig.outcome("d").reason is FinishReason.OK
    rig.check_whole()
    assert events.events[-1] == ("cleared",) and not events.live


LIVE = ("bootstrapping", "waiting", "prefilling", "in_forward", "transferring")
TARGET = {
    "bootstrapping": RequestState.BOOTSTRAPPING,
    "waiting": RequestState.WAITING,
    "prefilling": RequestState.PREFILLING,
    "in_forward": RequestState.PREFILLING,
    "transferring": RequestState.TRANSFERRING,
}


@pytest.mark.parametrize("state", LIVE)
@pytest.mark.parametrize("overlap", [False, True])
def test_abort_in_every_state_with_shared_pages(state: str, overlap: bool) -> None:
    """``a``'s pages are cached; ``holder`` hits them and stays transferring; ``b`` hits them
    too (once admitted) and is aborted in ``state`` ("in_forward": while a forward that
    writes its pages runs, overlap only). Then everything finishes, a last request on the
    same prefix still reads the right tokens, and the pools are whole."""
    rig, states = cached_rig(overlap=overlap, auto_want=False, num_pages=32)
    a = tokens(32, 12)
    rig.prefill("a", 0, token_ids=a)
    rig.sender("a").want()
    rig.run_until_idle()
    rig.backend.polls_to_success = None  # from here on transfers stall until released
    rig.prefill("holder", 0, token_ids=[*a[:24], *tokens(8, 13)])
    rig.sender("holder").want()
    rig.steps(6)
    assert states.state["holder"] is RequestState.TRANSFERRING
    if state == "waiting":  # every page taken: b waits
        rig.prefill("blocker", 0, token_ids=tokens(PS * rig.engine.load.num_free_pages, 14))
        rig.sender("blocker").want()
        rig.steps(10)
    rig.prefill("b", 0, token_ids=[*a[:28], *tokens(36, 15)])  # 16 pages, up to 7 a hit
    if state != "bootstrapping":
        rig.sender("b").want()
    for _ in range(40):
        if states.state.get("b", RequestState.BOOTSTRAPPING) is TARGET[state]:
            break
        rig.steps(1)
    assert states.state.get("b", RequestState.BOOTSTRAPPING) is TARGET[state], states.state
    gate = None
    if state == "in_forward" and overlap:
        gate = rig.runner.gate = threading.Event()
        rig.runner.started.clear()
        rig.steps(1)  # launches b's next chunk, which waits on the gate
        assert rig.runner.started.wait(timeout=10)
    rig.abort("b")
    out = rig.outcome("b")
    assert (out.status, out.reason) == (OutcomeStatus.ABORTED, FinishReason.ABORTED_BY_ROUTER)
    rig.engine.check_integrity()
    if gate is not None:
        gate.set()
    for sender in rig.backend.all_senders:
        sender.polls_to_success = 0
    rig.backend.polls_to_success = 0
    rig.run_until_idle()
    rig.engine.check_integrity()
    rig.prefill("after", 0, token_ids=[*a[:28], *tokens(6, 16)])
    rig.sender("after").want()
    rig.run_until_idle()
    assert states.lookups[-1][1] >= 24  # a's pages still serve (the blocker may evict one)
    check_ok(rig, "after", states.lookups[-1][1])
    assert not rig.runner.errors
    rig.check_whole()
    rig.engine.shutdown()
