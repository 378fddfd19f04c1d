"""The step exchange: the leader broadcasts each step to every rank, every rank answers.

One exchange, over the group's control process group (gloo, on CPU even when the model's
collectives run on NCCL: the step is a few kilobytes of msgpack)::

    leader                                   follower r
    broadcast header [kind, num_bytes] ───▶  receive header
    broadcast payload uint8[num_bytes] ───▶  receive the body (plan, transfer ops, rooms,
                                             vLLM stages); apply the ops to its own
                                             backend, run the stages (its heads)
    its forward (samples)                    its forward (its heads; no sampling)
    all_reduce SUM float64[size, 4]  ◀──▶    its row: [1.0, its forward seconds, the bytes
                                             its KV writes landed since its last answer,
                                             the decode ranks it holds an agent for]
    all_reduce MIN int64[2 rooms]    ◀──▶    its state code, then settled flag, per room
                                             (only with rooms; ``tp/mirror.py``)

so after each exchange every rank has answered, the leader knows each rank's forward time
and written bytes (its own row's are 0: the leader's writes are counted per request, by its
sender), each follower's decode ranks (``MirrorTarget.num_peers``: a gauge, so a follower
that forgot a dropped decode shows it; the leader's own row is 0), and the group's state of
every open room (``tp/mirror.py``). The leader hands the followers' bytes to ``on_written``
in every exchange (a heartbeat's too: writes land between forwards), and their decode ranks
to ``on_decode_peers``, before it stores the rooms' states: a request that a follower's
landed writes let succeed ends with those bytes already counted. Bytes ride as float64,
exact below 2^53 per step. The reply's shape is not versioned, unlike a message between
programs: every rank runs the leader's own install (the leader starts them, or torchrun runs
the same command on each).

Exchanges are serialised by a lock (the forward thread, the heartbeat thread and the engine's
transfer polls share the channel): the collectives pair up by order, so the order must be the
same everywhere. Every wait is bounded by the process group's timeout
(``parallel.step_timeout_s``); a rank that died breaks the next collective at once (its socket
closes). After any failure the channel is broken for good: the group cannot recover a half-run
collective.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from prefill_worker.batch import BatchPlan
from prefill_worker.tp.mirror import RankLink, no_opinion
from prefill_worker.tp.step import Step, StepKind, decode_step, encode_step
from prefill_worker.transfer.vllm.shared import StageQueue

T = TypeVar("T")
_HEADER = 2  # int64: kind, payload bytes
_REPLY = 4  # float64 per rank: answered (1.0), forward seconds, written bytes, decode peers


class GroupFailed(RuntimeError):
    """A rank died, hung past the step timeout, or failed its forward: the group is lost."""


@dataclass(frozen=True, slots=True)
class StepReplies:
    forward_s: tuple[float, ...]  # per rank, rank order (0.0 for a step without a forward)
    written_bytes: tuple[int, ...]  # per rank: landed since its last answer (leader: 0)
    decode_peers: tuple[int, ...]  # per rank: decode ranks it holds an agent for (leader: 0)


class LeaderChannel:
    """Rank 0's end. ``exchange`` from any thread; one exchange at a time."""

    def __init__(
        self,
        group: Any,
        size: int,
        link: RankLink | None = None,
        clock: Callable[[], float] = time.monotonic,
        sync_interval_s: float = 0.002,
    ) -> None:
        """``link``: the transfer mirror's queue (``tp/mirror.py``); its ``try_exchange``
        becomes this channel's ``try_sync``."""
        self._group, self._size, self.clock = group, size, clock
        self.link, self._sync_interval_s = link or RankLink(), sync_interval_s
        self.link.try_exchange = self.try_sync
        self.stages = StageQueue()  # vLLM repacks for the followers (transfer/vllm/shared)
        self._lock = threading.Lock()
        self._waiting_since: float | None = None  # an exchange waits on the other ranks
        self._is_closed = False
        self.last_exchange_at = clock()
        self.failure: str | None = None  # set once: why the group is lost
        # Each exchange's written bytes per rank (rank order); set by the channel's owner.
        self.on_written: Callable[[tuple[int, ...]], None] = lambda written: None
        # ... and each rank's decode peers (rank order).
        self.on_decode_peers: Callable[[tuple[int, ...]], None] = lambda peers: None

    def exchange(
        self,
        kind: StepKind,
        plan: BatchPlan | None = None,
        work: Callable[[], T] | None = None,
    ) -> tuple[T | None, StepReplies]:
        """Send the step, run ``work`` (the leader's share), gather the replies."""
        with self._lock:
            return self._exchange(kind, plan, work)

    def try_sync(self) -> None:
        """A HEARTBEAT now, for the transfer ops and room states, unless a step is running
        (its own exchange carries them) or one ended under ``sync_interval_s`` ago."""
        if self.clock() - self.last_exchange_at < self._sync_interval_s:
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._exchange(StepKind.HEARTBEAT, None, None)
        finally:
            self._lock.release()

    def _exchange(
        self, kind: StepKind, plan: BatchPlan | None, work: Callable[[], T] | None
    ) -> tuple[T | None, StepReplies]:
        if self.failure is not None or self._is_closed:
            raise GroupFailed(self.failure or "the group was stopped")
        ops, rooms = self.link.take()
        stages, staged = self.stages.take()
        try:
            self._waiting_since = self.clock()
            _send(self._group, kind, encode_step(plan, ops, rooms, stages))
            self._waiting_since = None  # the leader's own share is not a wait on ranks
            started = time.perf_counter()
            result = work() if work is not None else None
            forward_s = time.perf_counter() - started
            self._waiting_since = self.clock()
            replies = _gather(self._group, self._size, 0, forward_s, 0, 0)
            # Counted before the rooms' states are stored: before any request they end.
            self.on_written(replies.written_bytes)
            self.on_decode_peers(replies.decode_peers)
            if rooms:
                self.link.store(rooms, _agree(self._group, no_opinion(len(rooms))))
        except Exception as exc:
            self.failure = f"tensor-parallel step failed: {type(exc).__name__}: {exc}"
            self.stages.fail(staged, GroupFailed(self.failure))
            raise GroupFailed(self.failure) from exc
        finally:
            self._waiting_since = None
        self.stages.done(staged)  # every follower ran them before it answered
        self.last_exchange_at = self.clock()
        return result, replies

    def stop(self) -> None:
        """Tell the followers to leave (no reply); nothing when the group already failed."""
        with self._lock:
            if self.failure is not None or self._is_closed:
                return
            self._is_closed = True
            try:
                _send(self._group, StepKind.STOP, b"")
            except Exception as exc:
                self.failure = f"stop step failed: {exc}"

    def waiting_for(self) -> float:
        """Seconds the exchange in progress has waited (0.0 when none is)."""
        since = self._waiting_since
        return 0.0 if since is None else self.clock() - since


class FollowerChannel:
    """Rank ``rank``'s end: receive a step, answer it."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self._group, self._rank, self._size = group, rank, size

    def receive(self) -> tuple[StepKind, Step | None]:
        """The next step (None for STOP, which has no body)."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        kind, num_bytes = StepKind(int(header[0])), int(header[1])
        if not num_bytes:
            return kind, None
        payload = torch.empty(num_bytes, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self._group)
        return kind, decode_step(payload.numpy().tobytes())

    def answer(
        self,
        forward_s: float,
        room_codes: Sequence[int],
        written_bytes: int,
        decode_peers: int = 0,
    ) -> None:
        """This rank's reply; ``room_codes``: its answer for the step's rooms (``tp/mirror``);
        ``written_bytes``: what its writes landed since its last answer; ``decode_peers``:
        the decode ranks it holds an agent for now."""
        _gather(self._group, self._size, self._rank, forward_s, written_bytes, decode_peers)
        if room_codes:
            _agree(self._group, room_codes)


def _send(group: Any, kind: StepKind, payload: bytes) -> None:
    header = torch.tensor([int(kind), len(payload)], dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # [num_bytes]
        dist.broadcast(data, src=0, group=group)


def _agree(group: Any, codes: Sequence[int]) -> list[int]:
    """Each entry's lowest value over the ranks."""
    tensor = torch.tensor(list(codes), dtype=torch.int64)  # [2 rooms]
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return [int(code) for code in tensor.tolist()]


def _gather(
    group: Any, size: int, rank: int, forward_s: float, written_bytes: int, decode_peers: int
) -> StepReplies:
    rows = torch.zeros((size, _REPLY), dtype=torch.float64)  # [size, 4]
    rows[rank] = torch.tensor([1.0, forward_s, written_bytes, decode_peers], dtype=torch.float64)
    dist.all_reduce(rows, group=group)
    if not bool((rows[:, 0] == 1.0).all()):
        raise GroupFailed(f"step replies incomplete: {rows[:, 0].tolist()}")
    written = tuple(int(n) for n in rows[:, 2].tolist())
    peers = tuple(int(n) for n in rows[:, 3].tolist())
    return StepReplies(tuple(rows[:, 1].tolist()), written, peers)
