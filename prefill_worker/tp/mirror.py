"""Both ends of the transfer mirror (``transfer/group.py``): the leader's queue of sender ops
and the followers' agreed room states (``RankLink``), and a follower's replay of those ops on
its own backend (``MirrorTarget``).

The ops ride on the group's steps (``channel.py``): every step carries what was queued since
the last one and the rooms still open; after it, each rank's answer for those rooms goes into
one all-reduce MIN::

    answer   [code of room 1 .. code of room n | settled 1 .. settled n]    int64 [2n]
             code: STATE_CODES; settled: 1 when no write of the room can land from this rank

The leader contributes SUCCESS and settled (no opinion: its own state is combined by
``GroupSender.poll``, its own writes waited for by its sender), so the result is the
followers' lowest state and whether every follower is settled. A follower releases a room's
writes when its fail or close comes; the leader counts "settled" only from an exchange that
carried that fail or close (an earlier one may predate writes still queued), and keeps a
closed room in the exchanges until its followers settled it.

A follower also reports the bytes its writes landed since its last answer
(``MirrorTarget.take_written_bytes``), in the same step answer as its forward seconds
(``channel.py``): rooms need not be open for it, and the leader only sums them.
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
SETTLED, UNSETTLED = 1, 0
_PUSHING = (KVPoll.READY, KVPoll.TRANSFERRING)
_ENDING = ("fail", "close")  # ops after which a follower releases the room's writes


def no_opinion(num_rooms: int) -> list[int]:
    """An answer that changes no room's agreement (the module docstring's layout)."""
    return [NO_OPINION] * num_rooms + [SETTLED] * num_rooms


class RankLink:
    """The leader's end. ``mirror`` and ``followers_state`` on the engine thread; ``take`` and
    ``store`` inside the channel's exchanges (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[MirrorOp] = []
        self._open: dict[int, None] = {}  # rooms with a sender, in creation order
        self._closing: dict[int, None] = {}  # closed rooms some follower may still write
        self._states: dict[int, KVPoll] = {}
        self._asked: set[int] = set()  # rooms whose fail or close went to the followers
        self._settled: set[int] = set()  # ... and every follower since answered settled
        self.try_exchange: Callable[[], None] = lambda: None  # set by the channel's owner

    def mirror(self, op: MirrorOp) -> None:
        with self._lock:
            self._pending.append(op)
            if op.kind == "create":
                self._forget(op.room)
                self._open[op.room] = None
            elif op.kind == "close":
                self._states.pop(op.room, None)
                if op.room in self._open:
                    del self._open[op.room]
                    self._closing[op.room] = None

    def followers_state(self, room: int) -> KVPoll | None:
        with self._lock:
            return self._states.get(room)

    def followers_settled(self, room: int) -> bool:
        """Every follower answered settled since the room's fail or close reached it (a room
        no longer tracked: closed and settled)."""
        with self._lock:
            is_tracked = room in self._open or room in self._closing
            return room in self._settled or not is_tracked

    def sync(self) -> None:
        if self.has_work():
            self.try_exchange()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._pending or self._open or self._closing)

    def take(self) -> tuple[list[MirrorOp], list[int]]:
        """What the next step carries: the ops queued since the last, the open rooms and the
        closed ones not settled yet."""
        with self._lock:
            ops, self._pending = self._pending, []
            for op in ops:  # in order: a room id used again is not asked by its old close
                if op.kind in _ENDING:
                    self._asked.add(op.room)
                elif op.kind == "create":
                    self._asked.discard(op.room)
            return ops, [*self._open, *self._closing]

    def store(self, rooms: Sequence[int], answer: Sequence[int]) -> None:
        """The agreed answer of the exchange that carried ``rooms`` (module docstring)."""
        codes, flags = answer[: len(rooms)], answer[len(rooms) :]
        with self._lock:
            for room, code, flag in zip(rooms, codes, flags, strict=True):
                if room in self._open:
                    self._states[room] = STATES[code]
                if flag != SETTLED or room not in self._asked:
                    continue
                if room in self._closing:
                    self._forget(room)  # nothing of it can land: the room leaves the link
                else:
                    self._settled.add(room)

    def _forget(self, room: int) -> None:
        self._closing.pop(room, None)
        self._states.pop(room, None)
        self._asked.discard(room)
        self._settled.discard(room)


class ReplayedSender(KVSender, Protocol):
    """A follower's sender: a ``KVSender`` that says when its writes are settled."""

    def settle(self) -> bool:
        """True once no write of the room can land from this rank (a failed or closed room
        has its writes released; a release NIXL refused is retried here)."""
        ...


class Replaying(Protocol):
    """What a follower's backend must do for the mirror (``transfer.nixl.rank_backend``)."""

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> ReplayedSender: ...

    def poll(self) -> None: ...

    def close(self) -> None: ...

    def add_peer(self, msg: wire.Register) -> None:
        """A decode rank the leader admitted: its agent and pool (op ``peer``)."""
        ...

    def drop_peer(self, agent_name: str) -> None:
        """A decode rank the leader dropped (op ``drop``, after its rooms' senders lost it):
        its agent goes once no write to it can land (an unknown name: nothing)."""
        ...

    @property
    def num_peers(self) -> int:
        """The decode ranks this rank holds an agent or writer for, leaving ones included."""
        ...

    def take_written_bytes(self) -> int:
        """The bytes of this rank's writes that landed since the last call."""
        ...


@runtime_checkable
class Binding(Protocol):
    """A follower's sender that learns the room's decode ranks and wants (op ``bind``)."""

    def bind(self, agent_names: Sequence[str], wants: Sequence[wire.Want]) -> None: ...


@runtime_checkable
class LosingPeers(Protocol):
    """A follower's sender that fails when a decode rank it writes to leaves (op ``drop``)."""

    def lose_peer(self, agent_name: str) -> None: ...


class MirrorTarget:
    """A follower's replay of the leader's sender ops on its own backend. Pages and the aux
    row wait until this rank's sender is READY (its decode may claim the room here later than
    at the leader); a fail or close applies at once. A ``peer`` op goes to the backend's
    ``add_peer``, a ``bind`` to the room's sender (``transfer.nixl.rank_backend``); a ``drop``
    to every open sender (``lose_peer``: those bound to the agent fail, releasing their
    writes), then to the backend's ``drop_peer``. A closed sender is kept until its writes
    settled, for the leader's ``followers_settled``."""

    def __init__(self, backend: Replaying) -> None:
        self._backend = backend
        self._senders: dict[int, ReplayedSender] = {}
        self._closing: dict[int, ReplayedSender] = {}  # closed, writes not settled yet
        self._waiting: dict[int, deque[MirrorOp]] = {}

    def apply(self, ops: Sequence[MirrorOp]) -> None:
        for op in ops:
            self._apply(op)
        self._backend.poll()
        self._flush()

    def codes(self, rooms: Sequence[int]) -> list[int]:
        """This rank's answer for ``rooms`` (the module docstring's layout): a state code per
        room (``NO_OPINION`` for a room it holds no sender for), then a settled flag per room."""
        self._backend.poll()
        self._flush()
        self._closing = {r: s for r, s in self._closing.items() if not s.settle()}
        codes = [
            STATE_CODES[self._senders[room].poll()] if room in self._senders else NO_OPINION
            for room in rooms
        ]
        return codes + [UNSETTLED if self._is_unsettled(room) else SETTLED for room in rooms]

    def take_written_bytes(self) -> int:
        """The bytes this rank's writes landed since the last call (counted when ``codes``
        or ``apply`` polled them: ask after ``codes``, for the step's answer)."""
        return self._backend.take_written_bytes()

    @property
    def num_peers(self) -> int:
        """The decode ranks this rank holds an agent for (its step answer's gauge)."""
        return self._backend.num_peers

    def close(self) -> None:
        """Close every sender left, then the backend."""
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
        self._backend.close()

    def _is_unsettled(self, room: int) -> bool:
        if room in self._closing:
            return True
        return room in self._senders and not self._senders[room].settle()

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
            sender = self._senders.pop(op.room)
            sender.close()
            self._closing[op.room] = sender
        elif op.kind == "peer" and op.register is not None:
            self._backend.add_peer(op.register)
        elif op.kind == "drop":
            for name in op.agent_names:
                for sender in self._senders.values():
                    if isinstance(sender, LosingPeers):
                        sender.lose_peer(name)
                self._backend.drop_peer(name)
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
                    sender.send_pages(op.page_ids, op.first, op.sliding_page_ids)
                else:
                    sender.send_aux(op.first)
