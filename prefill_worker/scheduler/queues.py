"""Live requests by state: the bootstrap, waiting, prefilling and inflight queues.

Every state move of a live request goes through ``RequestQueues.move``, which checks the edge
(``Request.move_to``), keeps the containers and per-state counts in step, and then reports the
move to ``on_move`` (the engine passes its observer's ``on_transition``)::

    live        request_id -> Request, every non-terminal request
    waiting     deque, FCFS order: the admission queue of claimed requests (WAITING)
    speculative deque, FCFS order: with optimistic prefill, the BOOTSTRAPPING requests with an
                attempt left (``Request.is_admissible``), admitted only after the claimed
                ones (``admission``); in both, entries that left are dropped at the head
    prefilling  request_id -> Request, admission order
    held        request_id -> Request, the PREFILLING ones whose prefill is done and whose
                decode has not asked yet (optimistic prefill): oldest first
    inflight    request_id -> Request (TRANSFERRING: KV pushed, waiting for the sender)
    watch ring  BOOTSTRAPPING and WAITING requests whose senders are polled a few per turn
                (O(poll budget) a turn); entries that left those states are dropped as the
                ring reaches them, each once, and never count against the budget
    by_room     bootstrap_room -> the live requests with it (one, but for a duplicate the
                transfer backend refuses): a claim it reports by room finds its request
                without a scan
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from prefill_worker.request import RequestState
from prefill_worker.scheduler.tracked import Request

_WATCHED = (RequestState.BOOTSTRAPPING, RequestState.WAITING)

OnMove = Callable[[str, RequestState, RequestState], None]  # (request_id, src, dst)


def _ignore(request_id: str, src: RequestState, dst: RequestState) -> None:
    return None


class RequestQueues:
    """The engine thread's view of every live request; nothing else mutates it."""

    def __init__(self, on_move: OnMove = _ignore) -> None:
        self._on_move = on_move
        self.live: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.speculative: deque[Request] = deque()
        self.prefilling: dict[str, Request] = {}
        self.inflight: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        self.by_room: dict[int, list[Request]] = {}
        self._watch: deque[Request] = deque()
        self.num_bootstrapping = 0  # ints, not a dict keyed by state: Enum.__hash__ is slow
        self.num_waiting = 0
        self.num_queued_tokens = 0  # prompt tokens of BOOTSTRAPPING and WAITING requests
        self.num_arrived_tokens = 0  # prompt tokens of every request added, ever

    def __len__(self) -> int:
        return len(self.live)

    def add(self, req: Request) -> None:
        """A new request, in BOOTSTRAPPING."""
        assert req.state is RequestState.BOOTSTRAPPING and req.request_id not in self.live
        self.live[req.request_id] = req
        self.by_room.setdefault(req.room, []).append(req)
        self.num_bootstrapping += 1
        self.num_queued_tokens += req.num_prompt_tokens
        self.num_arrived_tokens += req.num_prompt_tokens
        self._watch.append(req)
        if req.is_admissible:
            self._enqueue(req)

    @property
    def num_running(self) -> int:
        """Prefilling requests that still compute (the held ones wait for their decode)."""
        return len(self.prefilling) - len(self.held)

    def hold(self, req: Request) -> None:
        assert req.state is RequestState.PREFILLING and req.held_at is not None
        self.held[req.request_id] = req

    def unhold(self, req: Request) -> None:
        del self.held[req.request_id]
        req.held_at = req.held_token = None

    def oldest_held(self) -> Request | None:
        return next(iter(self.held.values()), None)

    def _enqueue(self, req: Request) -> None:
        if req.state is RequestState.WAITING:
            if not req.is_queued:
                req.is_queued = True
                self.waiting.append(req)
        elif not req.is_speculating:
            req.is_speculating = True
            self.speculative.append(req)

    def move(self, req: Request, state: RequestState) -> None:
        old = req.state
        req.move_to(state)
        if old in _WATCHED and state not in _WATCHED:
            self.num_queued_tokens -= req.num_prompt_tokens
        elif state in _WATCHED and old not in _WATCHED:  # a yield: queued again
            self.num_queued_tokens += req.num_prompt_tokens
        if old is RequestState.BOOTSTRAPPING:
            self.num_bootstrapping -= 1
        elif old is RequestState.WAITING:
            self.num_waiting -= 1
        elif old is RequestState.PREFILLING:
            del self.prefilling[req.request_id]
            if self.held.pop(req.request_id, None) is not None:
                req.held_at = req.held_token = None
        elif old is RequestState.TRANSFERRING:
            del self.inflight[req.request_id]
        if state is RequestState.WAITING:
            self.num_waiting += 1
            self._enqueue(req)
        elif state is RequestState.BOOTSTRAPPING:
            self.num_bootstrapping += 1
            self._watch.append(req)
            if req.is_admissible:
                self._enqueue(req)
        elif state is RequestState.PREFILLING:
            self.prefilling[req.request_id] = req
        elif state is RequestState.TRANSFERRING:
            self.inflight[req.request_id] = req
        else:
            assert state.is_terminal
            del self.live[req.request_id]
            same_room = self.by_room[req.room]
            same_room.remove(req)
            if not same_room:
                del self.by_room[req.room]
        self._on_move(req.request_id, old, state)

    def counts(self) -> dict[RequestState, int]:
        """Live requests per live state."""
        return {
            RequestState.BOOTSTRAPPING: self.num_bootstrapping,
            RequestState.WAITING: self.num_waiting,
            RequestState.PREFILLING: len(self.prefilling),
            RequestState.TRANSFERRING: len(self.inflight),
        }

    def head_waiting(self) -> Request | None:
        """The oldest claimed request waiting for admission, or None."""
        waiting = self.waiting
        while waiting and waiting[0].state is not RequestState.WAITING:
            waiting.popleft()  # an ended request: it leaves the queue only by popping
        return waiting[0] if waiting else None

    def head_speculative(self) -> Request | None:
        """The oldest unclaimed request with an optimistic attempt left, or None."""
        speculative = self.speculative
        while speculative and not (
            speculative[0].state is RequestState.BOOTSTRAPPING and speculative[0].is_admissible
        ):
            speculative.popleft().is_speculating = False  # claimed or ended since
        return speculative[0] if speculative else None

    def pop_admitted(self, req: Request) -> None:
        """``req``, the head of its queue, is admitted."""
        if req.state is RequestState.WAITING:
            assert self.waiting[0] is req
            self.waiting.popleft()
            req.is_queued = False
        else:
            assert self.speculative[0] is req and req.is_admissible
            self.speculative.popleft()
            req.is_speculating = False

    def next_watched(self, budget: int) -> list[Request]:
        """Up to ``budget`` BOOTSTRAPPING/WAITING requests, round-robin across turns; the
        ended ones met on the way are dropped, uncounted."""
        picked: list[Request] = []
        for _ in range(len(self._watch)):
            if len(picked) == budget:
                break
            req = self._watch.popleft()
            if req.state in _WATCHED:
                self._watch.append(req)
                picked.append(req)
        return picked

    def check_integrity(self) -> None:
        for state, count in self.counts().items():
            assert count == sum(1 for r in self.live.values() if r.state is state), state
        assert all(r.state is RequestState.PREFILLING for r in self.prefilling.values())
        assert all(r.state is RequestState.TRANSFERRING for r in self.inflight.values())
        waiting = [r for r in self.waiting if r.state is RequestState.WAITING]
        assert len(waiting) == self.num_waiting
        assert all(r.is_queued for r in self.waiting)
        assert all(r.is_speculating for r in self.speculative)
        for queue in (self.waiting, self.speculative):
            assert len(queue) == len(set(map(id, queue)))
        for req in self.live.values():
            if req.state is RequestState.WAITING:
                assert req.is_queued, req
            elif req.is_admissible:
                assert req.is_speculating, req
        for request_id, req in self.held.items():
            assert self.prefilling.get(request_id) is req and req.held_at is not None
        queued = sum(r.num_prompt_tokens for r in self.live.values() if r.state in _WATCHED)
        assert queued == self.num_queued_tokens, (queued, self.num_queued_tokens)
        mapped = [r for reqs in self.by_room.values() for r in reqs]
        assert all(reqs for reqs in self.by_room.values())
        assert sorted(map(id, mapped)) == sorted(map(id, self.live.values()))
        assert all(r.room == room for room, reqs in self.by_room.items() for r in reqs)
        watched = {id(r) for r in self._watch if r.state in _WATCHED}
        assert all(id(r) in watched for r in self.live.values() if r.state in _WATCHED)
