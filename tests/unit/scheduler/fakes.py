"""Test seams for the scheduler: a clock, a KV-writing runner, and a scripted sender/backend.

``FakeRunner`` keeps a token per page slot, so a chunk that lands in the wrong pages (or pages
reused too early, or a prefix-cache hit on the wrong pages) changes the first token: it is the
sum of the prompt as read back from the request's pages, modulo ``TOKEN_MOD``. Writing a page
that is free or shared (refcount other than 1: cached, or another request's) is an error, and
so is a chunk whose earlier positions do not read back as its prompt when it runs (a prefix
hit on pages that were not complete yet).
Prompt logprobs are ``fake_logprob(position, token)`` for each position a chunk names, after
checking that the scored token is the prompt's next one (when the prompt is known).
``FakeSender`` records what the engine sent and checks the sender contract (nothing after
close, pages still allocated when close runs). ``MirroringFakeSender`` (``make_rig(mirror=
True)``) also gives chunks planned once it is READY mirror slots, and the runner reports each
mirrored chunk it computes to it: a forward writing the slots of a closed sender is an error.
"""

from __future__ import annotations

import math
import select
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefill_worker.batch import BatchOutput, BatchPlan, ChunkPlan, PromptLogprobs, SampledToken
from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.cache_events import CacheEventSink
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.request import AbortRequest, PrefillRequest, SamplingParams, TransferStats
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from prefill_worker.scheduler.observer import EngineObserver
from prefill_worker.transfer.base import KVPoll
from tests.clocks import FakeClock

TOKEN_MOD = 997


def expected_token(token_ids: Sequence[int]) -> int:
    return sum(token_ids) % TOKEN_MOD


def fake_logprob(position: int, token_id: int) -> float:
    """What ``FakeRunner`` reports for position ``position`` scoring ``token_id``."""
    return -(position * 1000 + token_id) / 1e6


class FakeRunner:
    """Writes each chunk's tokens into its pages; the last chunk reads the prompt back."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool, self.page_size = pool, page_size
        self.kv: list[list[int | None]] = [[None] * page_size for _ in range(pool.num_pages)]
        self.plans: list[BatchPlan] = []
        self.errors: list[str] = []
        self.gate: threading.Event | None = None  # when set by a test: run() waits for it
        self.started = threading.Event()
        self.fail_with: Exception | None = None
        self.sample_errors: dict[str, str] = {}  # request_id -> its row's sampling error
        self.prompts: dict[str, Sequence[int]] = {}  # request_id -> prompt, when known
        self.on_run: Callable[[BatchPlan], None] | None = None  # a test's hook (e.g. a clock)
        self.on_mirror: Callable[[ChunkPlan], None] | None = None  # each mirrored chunk computed

    def run(self, plan: BatchPlan) -> BatchOutput:
        if self.on_run is not None:
            self.on_run(plan)
        self.started.set()
        if self.gate is not None:
            self.gate.wait(timeout=10)
        if self.fail_with is not None:
            raise self.fail_with
        self.plans.append(plan)
        sampled, scored = [], []
        for chunk in plan.chunks:
            self._check_prefix(chunk.request_id, chunk.page_ids, chunk.start)
            for offset, token in enumerate(chunk.token_ids):
                self._slot_write(chunk.page_ids, chunk.start + offset, token)
            if chunk.mirror_slots and self.on_mirror is not None:
                self.on_mirror(chunk)
            if chunk.logprob_token_ids:
                scored.append(self._score(chunk))
            if chunk.sampling is not None:
                prompt = [self._slot_read(chunk.page_ids, pos) for pos in range(chunk.end)]
                token_id = sum(t or 0 for t in prompt) % TOKEN_MOD
                error = self.sample_errors.get(chunk.request_id)
                sampled.append(SampledToken(chunk.request_id, token_id, -0.5, error))
        return BatchOutput(plan.batch_id, tuple(sampled), tuple(scored))

    def _score(self, chunk: ChunkPlan) -> PromptLogprobs:
        first, targets = chunk.logprob_from, chunk.logprob_token_ids
        if not chunk.start <= first <= chunk.end - len(targets):
            self.errors.append(f"{chunk.request_id}: scored positions outside its chunk")
        prompt = self.prompts.get(chunk.request_id)
        if prompt is not None and list(targets) != list(
            prompt[first + 1 : first + 1 + len(targets)]
        ):
            self.errors.append(f"{chunk.request_id}: scored tokens are not the next ones")
        values = (fake_logprob(first + i, t) for i, t in enumerate(targets))
        return PromptLogprobs(chunk.request_id, tuple(values))

    def _check_prefix(self, request_id: str, page_ids: Sequence[int], start: int) -> None:
        prompt = self.prompts.get(request_id)
        if prompt is None:
            return
        got = [self._slot_read(page_ids, pos) for pos in range(start)]
        if got != list(prompt[:start]):
            self.errors.append(f"{request_id}: positions [0, {start}) do not hold its prompt")

    def _slot_write(self, page_ids: Sequence[int], pos: int, token: int) -> None:
        page_id = page_ids[pos // self.page_size]
        if self.pool.refcount(page_id) != 1:
            self.errors.append(f"wrote page {page_id} with {self.pool.refcount(page_id)} owners")
        self.kv[page_id][pos % self.page_size] = token

    def _slot_read(self, page_ids: Sequence[int], pos: int) -> int | None:
        return self.kv[page_ids[pos // self.page_size]][pos % self.page_size]


class FakeSender:
    def __init__(self, backend: FakeBackend, room: int, request_id: str, num_tokens: int) -> None:
        self.backend, self.room, self.request_id, self.num_tokens = (
            backend,
            room,
            request_id,
            num_tokens,
        )
        self.state = KVPoll.READY if backend.auto_want else KVPoll.BOOTSTRAPPING
        self.cached = 0
        self.sent: list[tuple[tuple[int, ...], int]] = []
        self.sliding_sent: list[tuple[int, ...]] = []  # a windowed pool's entries, per send
        self.aux: list[AuxRow] = []
        self.worker_failure: str | None = None
        self.decode_failure: str | None = None
        self.is_closed = False
        self.polls_to_success: int | None = backend.polls_to_success
        self.errors: list[str] = []
        self.allowed_peer: str | None = None
        self.traceparent: str | None = None  # what create_sender was given
        self.send_raises: Exception | None = None  # set by a test: send_pages raises it
        self.poll_raises: Exception | None = None  # set by a test: poll raises it
        self.is_settled = True  # a follower's: no write of it can land (set by a test)
        self.other_writes: list[object] = []  # what also_wait_for was given

    # the engine's side
    def poll(self) -> KVPoll:
        if self.poll_raises is not None:
            raise self.poll_raises
        if self.state is KVPoll.TRANSFERRING and self.aux and self.polls_to_success is not None:
            if self.polls_to_success <= 0:
                self.state = KVPoll.SUCCESS
            self.polls_to_success -= 1
        return self.state

    def num_cached_tokens(self) -> int:
        return self.cached

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        if self.send_raises is not None:
            raise self.send_raises
        self._expect(not self.is_closed and self.state in (KVPoll.READY, KVPoll.TRANSFERRING))
        self._expect(all(self.backend.pool.refcount(p) > 0 for p in page_ids))
        self._expect(not sliding_page_ids or len(sliding_page_ids) == len(page_ids))
        self.sent.append((tuple(page_ids), first_page))
        self.sliding_sent.append(tuple(sliding_page_ids))
        self.state = KVPoll.TRANSFERRING

    def send_aux(self, aux_row: int) -> None:
        self._expect(not self.is_closed and self.state is KVPoll.TRANSFERRING and not self.aux)
        self.aux.append(self.backend.aux.read(aux_row))

    def fail(self, reason: str) -> None:
        self._expect(not self.is_closed)
        self.worker_failure = self.worker_failure or reason
        if not self.state.is_terminal:
            self.state = KVPoll.FAILED

    def failure_reason(self) -> str | None:
        return self.decode_failure or self.worker_failure

    def why_no_handshake(self) -> str | None:
        return None

    def settle(self) -> bool:
        return self.is_settled

    def also_wait_for(self, writes: object) -> None:
        self.other_writes.append(writes)

    def transfer_stats(self) -> TransferStats:
        """One byte per page sent, and one for the aux row: enough to see it counted."""
        return TransferStats(len(self.prompt_pages_sent()) + len(self.aux))

    def close(self) -> None:
        self._expect(not self.is_closed)
        for page_ids, _ in self.sent:
            self._expect(all(self.backend.pool.refcount(p) > 0 for p in page_ids))
        self.is_closed = True

    # the decode side, driven by tests
    def want(self, num_cached_tokens: int = 0) -> None:
        self.cached = num_cached_tokens
        self.state = KVPoll.READY
        self.backend.claimed.append(self.room)  # as a hub reports a bound room

    def decode_abort(self) -> None:
        self.state = KVPoll.ABORTED

    def break_(self, reason: str = "write failed", state: KVPoll = KVPoll.FAILED) -> None:
        self.decode_failure = reason
        self.state = state

    def _expect(self, ok: bool) -> None:
        if not ok:
            self.errors.append(f"{self.request_id}: contract broken in state {self.state}")

    def prompt_pages_sent(self) -> list[int]:
        return [first + i for page_ids, first in self.sent for i in range(len(page_ids))]


class MirroringFakeSender(FakeSender):
    """A sender whose destination the forward writes (``MirroringSender``): slot ``room *
    10_000 + position`` for each position of a chunk planned while READY or TRANSFERRING."""

    def __init__(self, backend: FakeBackend, room: int, request_id: str, num_tokens: int) -> None:
        super().__init__(backend, room, request_id, num_tokens)
        self.mirrored: list[tuple[int, int]] = []  # (start, end) of each chunk given slots
        self.mirror_written: list[tuple[int, int]] = []  # ... and computed by the runner

    def mirror_slots(self, start: int, end: int) -> Sequence[int]:
        if self.is_closed or self.state not in (KVPoll.READY, KVPoll.TRANSFERRING):
            return ()
        self.mirrored.append((start, end))
        return self.mirror_slots_of(start, end)

    def on_forward(self, chunk: ChunkPlan) -> None:
        """The runner computed a chunk with this sender's slots (it wrote them)."""
        self._expect(not self.is_closed)  # a closed sender's slots may be someone else's
        self._expect(list(chunk.mirror_slots) == self.mirror_slots_of(chunk.start, chunk.end))
        self.mirror_written.append((chunk.start, chunk.end))

    def mirror_slots_of(self, start: int, end: int) -> list[int]:
        return [self.room * 10_000 + p for p in range(start, end)]


@dataclass
class FakeBackend:
    pool: PagePool
    aux: AuxPool
    auto_want: bool = False
    polls_to_success: int | None = 0
    mirror: bool = False  # its senders are MirroringFakeSenders
    senders: dict[str, FakeSender] = field(default_factory=dict)
    all_senders: list[FakeSender] = field(default_factory=list)
    num_polls: int = 0
    num_waits: int = 0
    waited_s: float = 0.0  # time spent blocked in wait()
    claimed: list[int] = field(default_factory=list)  # rooms wanted since the engine looked

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> FakeSender:
        kind = MirroringFakeSender if self.mirror else FakeSender
        sender = kind(self, room, request_id, num_prompt_tokens)
        sender.allowed_peer = allowed_peer
        sender.traceparent = traceparent
        self.senders[request_id] = sender
        self.all_senders.append(sender)
        return sender

    def poll(self) -> None:
        self.num_polls += 1

    def take_claimed_rooms(self) -> list[int]:
        claimed, self.claimed = self.claimed, []
        return claimed

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Sleeps on ``wake_fd``; while a scripted transfer counts polls down, only briefly."""
        self.num_waits += 1
        if any(s.state is KVPoll.TRANSFERRING and s.aux for s in self.senders.values()):
            timeout_s = min(timeout_s, 0.001)
        started = time.monotonic()
        select.select([] if wake_fd is None else [wake_fd], [], [], max(timeout_s, 0.0))
        self.waited_s += time.monotonic() - started

    def close(self) -> None:
        return None


@dataclass
class Rig:
    """An engine with fakes around it, and what came out."""

    engine: Engine
    backend: FakeBackend
    runner: FakeRunner
    clock: FakeClock
    pool: PagePool
    aux: AuxPool
    page_size: int
    outcomes: list = field(default_factory=list)
    messages: dict[str, PrefillRequest] = field(default_factory=dict)

    def prefill(self, request_id: str, num_tokens: int, **kw: object) -> PrefillRequest:
        seed = zlib.crc32(request_id.encode())
        tokens = [(seed + 7919 * i) % 50000 for i in range(num_tokens)]
        fields: dict = dict(
            request_id=request_id,
            token_ids=tokens,
            sampling=SamplingParams(),
            return_logprob=True,
            bootstrap_room=len(self.messages) + 1,
            arrival_time=self.clock(),
        )
        fields.update(kw)
        msg = PrefillRequest(**fields)
        self.messages[request_id] = msg
        self.runner.prompts[request_id] = msg.token_ids
        self.engine.submit(msg)
        return msg

    def abort(self, request_id: str) -> None:
        self.engine.submit(AbortRequest(request_id))

    def sender(self, request_id: str) -> FakeSender:
        return self.backend.senders[request_id]

    def steps(self, n: int = 1) -> None:
        for _ in range(n):
            self.engine.step()

    def run_until_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            busy = self.engine.step()
            if not busy and self.engine.load.num_live == 0:
                return
        raise AssertionError(f"not idle after {max_steps} steps: {self.engine.load}")

    def outcome(self, request_id: str):  # type: ignore[no-untyped-def]
        found = [o for o in self.outcomes if o.request_id == request_id]
        assert len(found) == 1, found
        return found[0]

    def check_whole(self) -> None:
        """Nothing live: every page and aux row is back, no contract was broken. Every page
        the prefix cache still holds is idle: resetting it empties it (and the pool)."""
        self.engine.check_integrity()
        assert self.engine.load.num_free_pages == self.pool.num_pages
        assert self.engine.reset_prefix_cache()
        assert self.pool.num_free == self.pool.num_pages
        assert self.aux.num_free == self.aux.num_rows
        assert not self.runner.errors
        for sender in self.backend.all_senders:
            assert not sender.errors, sender.errors
            assert sender.is_closed


def make_rig(
    *,
    num_pages: int = 64,
    page_size: int = 4,
    chunk_size: int = 16,
    max_batch_tokens: int = 32,
    max_running_requests: int = 8,
    num_aux_rows: int = 8,
    bootstrap_timeout_s: float = 5.0,
    transfer_timeout_s: float = 5.0,
    overlap: bool = False,
    auto_want: bool = True,
    polls_to_success: int | None = 0,
    observer: EngineObserver | None = None,
    prefix_cache: bool = False,
    prefix_cache_max_pages: int | None = None,
    cache_events: CacheEventSink | None = None,
    optimistic: bool = False,
    optimistic_attempts: int = 2,
    optimistic_hold_s: float = 1.0,
    optimistic_share: float = 1.0,  # the tests before the share had all of it
    mirror: bool = False,
) -> Rig:
    clock = FakeClock()
    pool, aux = PagePool(num_pages), AuxPool(num_aux_rows)
    cache = None
    if prefix_cache:
        cache = PagePrefixCache(pool, page_size, prefix_cache_max_pages, cache_events)
    backend = FakeBackend(pool, aux, auto_want, polls_to_success, mirror=mirror)
    runner = FakeRunner(pool, page_size)
    if mirror:
        runner.on_mirror = lambda chunk: _mirroring(backend, chunk.request_id).on_forward(chunk)
    outcomes: list = []
    engine = Engine(
        runner,
        backend,
        EngineKV(pool, aux, cache),
        outcomes.append,
        EngineLimits(
            page_size=page_size,
            chunk_size=chunk_size,
            max_batch_tokens=max_batch_tokens,
            max_running_requests=max_running_requests,
            bootstrap_timeout_s=bootstrap_timeout_s,
            transfer_timeout_s=transfer_timeout_s,
            optimistic_prefill=optimistic,
            optimistic_attempts=optimistic_attempts,
            optimistic_hold_s=optimistic_hold_s,
            optimistic_share=optimistic_share,
        ),
        overlap=overlap,
        clock=clock,
        observer=observer,
    )
    return Rig(engine, backend, runner, clock, pool, aux, page_size, outcomes)


def _mirroring(backend: FakeBackend, request_id: str) -> MirroringFakeSender:
    sender = backend.senders[request_id]
    assert isinstance(sender, MirroringFakeSender)
    return sender


def is_nan(value: float) -> bool:
    return math.isnan(value)


class RecordingEvents:
    """A ``CacheEventSink`` that keeps every event, and the set of blocks a consumer that
    applied them would believe cached (``live``)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.live: dict[int, int | None] = {}  # block hash -> parent hash

    def blocks_stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        assert len(token_ids) == len(block_hashes) * block_size
        assert parent_block_hash is None or parent_block_hash in self.live, "unknown parent"
        self.events.append(("stored", tuple(block_hashes), parent_block_hash, tuple(token_ids)))
        for block in block_hashes:
            assert block not in self.live, f"block {block} stored twice"
            self.live[block] = parent_block_hash
            parent_block_hash = block

    def blocks_removed(self, block_hashes: Sequence[int]) -> None:
        self.events.append(("removed", tuple(block_hashes)))
        for block in block_hashes:
            del self.live[block]

    def all_cleared(self) -> None:
        self.events.append(("cleared",))
        self.live.clear()
