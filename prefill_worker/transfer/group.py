"""One ``TransferBackend`` over a tensor-parallel group: the leader's own backend, mirrored to
every follower's, and one agreed state per room.

At TP > 1 each rank pushes its own KV heads from its own pool through its own backend (own
NIXL agent, own registration). The engine still talks to one backend: this one. Every call a
sender gets (``create_sender``, ``send_pages``, ``send_aux``, ``fail``, ``close``) runs on the
leader's backend and is queued as a ``MirrorOp`` for the followers, which apply it to theirs
(``tp/mirror.py``; the ops travel on the group's next step, after the forward that computed
the pages). Each step the ranks agree each open room's state by one all-reduce MIN over
``STATE_CODES``::

    failed-like (any rank)  <  BOOTSTRAPPING  <  READY  <  TRANSFERRING  <  SUCCESS

so a room is SUCCESS only when every rank's writes landed, and failed as soon as any rank's
push failed (the code of the rank whose failure is lowest wins: PEER_LOST < ABORTED < FAILED).
Until the followers have answered for a room, its state is the leader's, capped at
TRANSFERRING: it never succeeds on the leader's word alone. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from prefill_worker.transfer.base import KVPoll, KVSender, TransferBackend

STATE_CODES: Mapping[KVPoll, int] = {
    KVPoll.PEER_LOST: 0,
    KVPoll.ABORTED: 1,
    KVPoll.FAILED: 2,
    KVPoll.BOOTSTRAPPING: 3,
    KVPoll.READY: 4,
    KVPoll.TRANSFERRING: 5,
    KVPoll.SUCCESS: 6,
}
STATES = {code: state for state, code in STATE_CODES.items()}
FOLLOWER_FAILED = "a tensor-parallel rank's push failed"


class MirrorOp(msgspec.Struct, array_like=True, frozen=True):
    """One sender call to repeat on every follower's backend (``kind``: create | pages | aux |
    fail | close; the fields each kind uses, the others left at their defaults)."""

    kind: str
    room: int
    request_id: str = ""
    num_prompt_tokens: int = 0
    allowed_peer: str | None = None
    page_ids: list[int] = []
    first: int = 0  # pages: the first prompt page; aux: the aux row
    reason: str = ""


class Mirror(Protocol):
    """What carries ops to the followers and their states back (``tp.mirror.RankLink``)."""

    def mirror(self, op: MirrorOp) -> None: ...

    def followers_state(self, room: int) -> KVPoll | None:
        """The lowest state the followers reported for ``room``; None before they did."""
        ...

    def sync(self) -> None:
        """Exchange what is queued now if the group is free (never waits for a forward)."""
        ...


def agree(states: Sequence[KVPoll]) -> KVPoll:
    """The group's state of a room: the lowest code over the ranks."""
    return STATES[min(STATE_CODES[state] for state in states)]


class GroupSender:
    def __init__(self, room: int, local: KVSender, mirror: Mirror) -> None:
        self._room, self._local, self._mirror = room, local, mirror

    def poll(self) -> KVPoll:
        mine, theirs = self._local.poll(), self._mirror.followers_state(self._room)
        if theirs is None:
            return agree([mine, KVPoll.TRANSFERRING])
        return agree([mine, theirs])

    def num_cached_tokens(self) -> int:
        return self._local.num_cached_tokens()

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        self._local.send_pages(page_ids, first_page)
        self._mirror.mirror(
            MirrorOp("pages", self._room, page_ids=list(page_ids), first=first_page)
        )

    def send_aux(self, aux_row: int) -> None:
        self._local.send_aux(aux_row)
        self._mirror.mirror(MirrorOp("aux", self._room, first=aux_row))

    def fail(self, reason: str) -> None:
        self._local.fail(reason)
        self._mirror.mirror(MirrorOp("fail", self._room, reason=reason))

    def failure_reason(self) -> str | None:
        mine = self._local.failure_reason()
        if mine is None and self.poll() in (KVPoll.FAILED, KVPoll.PEER_LOST, KVPoll.ABORTED):
            return FOLLOWER_FAILED
        return mine

    def why_no_handshake(self) -> str | None:
        return self._local.why_no_handshake()

    def written_bytes(self) -> int:
        return self._local.written_bytes()

    def close(self) -> None:
        self._local.close()
        self._mirror.mirror(MirrorOp("close", self._room))


class GroupBackend:
    """The leader's backend, every sender mirrored to the followers (module docstring)."""

    def __init__(self, local: TransferBackend, mirror: Mirror) -> None:
        self._local, self._mirror = local, mirror

    @property
    def bootstrap_endpoint(self) -> str:
        return self._local.bootstrap_endpoint

    @property
    def endpoints(self) -> Mapping[str, str]:
        return self._local.endpoints

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender:
        local = self._local.create_sender(room, request_id, num_prompt_tokens, allowed_peer)
        op = MirrorOp("create", room, request_id, num_prompt_tokens, allowed_peer)
        self._mirror.mirror(op)
        return GroupSender(room, local, self._mirror)

    def poll(self) -> None:
        self._local.poll()
        self._mirror.sync()

    def next_poll_at(self) -> float:
        return self._local.next_poll_at()

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        self._local.wait(timeout_s, wake_fd)

    def close(self) -> None:
        self._local.close()
