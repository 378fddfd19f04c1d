"""Both ends of the transfer mirror (``transfer/group.py``): the leader's queue of sender ops
and the followers' agreed room states (``RankLink``), and a follower's replay of those ops on
its own backend (``MirrorTarget``).

The ops ride on the group's steps (``channel.py``): every step carries what was queued since
the last one and the rooms still open; after it, each rank's state code for each of those
rooms goes into one all-reduce MIN. The leader contributes SUCCESS (no opinion: its own state
is combined by ``GroupSender.poll``), so the result is the followers' lowest.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll, KVSender
from prefill_worker.transfer.group import STATE_CODES, STATES, MirrorOp

NO_OPINION = STATE_CODES[KVPoll.SUCCESS]  # the highest code: MIN ignores it
_PUSHING = (KVPoll.READY, KVPoll.TRANSFERRING)


class RankLink:
    """The leader's end. ``mirror`` and ``followers_state`` on the engine thread; ``take`` and
    ``store`` inside the channel's exchanges (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[MirrorOp] = []
        self._open: dict[int, None] = {}  # rooms with a sender, in creation order
        self._states: dict[int, KVPoll] = {}
        self.try_exchange: Callable[[], None] = lambda: None  # set by the channel's owner

    def mirror(self, op: MirrorOp) -> None:
        with self._lock:
            self._pending.append(op)
            if op.kind == "create":
                self._open[op.room] = None
            if op.kind in ("create", "close"):
                self._states.pop(op.room, None)
            if op.kind == "close":
                self._open.pop(op.room, None)

    def followers_state(self, room: int) -> KVPoll | None:
        with self._lock:
            return self._states.get(room)

    def sync(self) -> None:
        if self.has_work():
            self.try_exchange()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._pending or self._open)

    def take(self) -> tuple[list[MirrorOp], list[int]]:
        """What the next step carries: the ops queued since the last, the open rooms."""
        with self._lock:
            ops, self._pending = self._pending, []
            return ops, list(self._open)

    def store(self, rooms: Sequence[int], codes: Sequence[int]) -> None:
        with self._lock:
            for room, code in zip(rooms, codes, strict=True):
                if room in self._open:
                    self._states[room] = STATES[code]


class Replaying(Protocol):
    """What a follower's backend must do for the mirror (``transfer.nixl.rank_backend``)."""

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender: ...

    def poll(self) -> None: ...

    def close(self) -> None: ...

    def add_peer(self, msg: wire.Register) -> None:
        """A decode rank the leader admitted: its agent and pool (op ``peer``)."""
        ...


@runtime_checkable
class Binding(Protocol):
    """A follower's sender that learns the room's decode ranks and wants (op ``bind``)."""

    def bind(self, agent_names: Sequence[str], wants: Sequence[wire.Want]) -> None: ...


class MirrorTarget:
    """A follower's replay of the leader's sender ops on its own backend. Pages and the aux
    row wait until this rank's sender is READY (its decode may claim the room here later than
    at the leader); a fail or close applies at once. A ``peer`` op goes to the backend's
    ``add_peer``, a ``bind`` to the room's sender (``transfer.nixl.rank_backend``)."""

    def __init__(self, backend: Replaying) -> None:
        self._backend = backend
        self._senders: dict[int, KVSender] = {}
        self._waiting: dict[int, deque[MirrorOp]] = {}

    def apply(self, ops: Sequence[MirrorOp]) -> None:
        for op in ops:
            self._apply(op)
        self._backend.poll()
        self._flush()

    def codes(self, rooms: Sequence[int]) -> list[int]:
        """This rank's state code per room (``NO_OPINION`` for a room it holds no sender for)."""
        self._backend.poll()
        self._flush()
        return [
            STATE_CODES[self._senders[room].poll()] if room in self._senders else NO_OPINION
            for room in rooms
        ]

    def close(self) -> None:
        """Close every sender left, then the backend."""
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        self._backend.close()

    def _apply(self, op: MirrorOp) -> None:
        if op.kind == "create":
            self._senders[op.room] = self._backend.create_sender(
                op.room, op.request_id, op.num_prompt_tokens, op.allowed_peer
            )
            self._waiting[op.room] = deque()
        elif op.kind in ("pages", "aux"):
            self._waiting[op.room].append(op)
        elif op.kind == "fail":
            self._senders[op.room].fail(op.reason)
        elif op.kind == "close":
            self._waiting.pop(op.room, None)
            self._senders.pop(op.room).close()
        elif op.kind == "peer" and op.register is not None:
            self._backend.add_peer(op.register)
        elif op.kind == "bind":
            sender = self._senders[op.room]
            if isinstance(sender, Binding):
                sender.bind(op.agent_names, op.wants)
            else:
                sender.fail("this rank's backend cannot bind decode ranks")

    def _flush(self) -> None:
        for room, queued in self._waiting.items():
            sender = self._senders[room]
            while queued and sender.poll() in _PUSHING:
                op = queued.popleft()
                if op.kind == "pages":
                    sender.send_pages(op.page_ids, op.first)
                else:
                    sender.send_aux(op.first)
