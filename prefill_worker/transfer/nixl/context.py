"""What a NIXL backend and its senders share: the decode peer record, the send context, and
the events senders leave in it for the backend.

A sender never calls back: what the backend must do (a status for a peer, forgetting a closed
sender, reaping writes not yet released) is appended to ``SendContext.events`` and done by the
backend, in order, when it drains them on its next ``poll()``. Senders post their writes
through ``SendContext.poster`` (``nixl.poster``): the transfer thread, or inline on the
caller's thread when none is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.agent import PreppedLists
from prefill_worker.transfer.nixl.poster import InlinePoster, Write, WritePoster
from prefill_worker.transfer.refused_names import RefusedNames

if TYPE_CHECKING:
    from prefill_worker.transfer.nixl.sender import NixlSender


@dataclass(eq=False)
class Peer:
    """A registered decode peer: its agent, its pool, its prepared descriptor list."""

    identity: bytes  # ZMQ routing id
    agent_name: str
    regions: KVRegions
    lists: PreppedLists  # its pool's descriptor lists, prepared at registration
    last_seen: float
    rooms: set[int] = field(default_factory=set)  # open senders bound to this peer
    unmatched: set[int] = field(default_factory=set)  # rooms it wants, no request yet
    num_claimed_pages: int = 0  # pages those wants name (rooms.RoomBook keeps it)


@dataclass(frozen=True, slots=True)
class Tell:
    """A status for the decode peer at ``identity``; with ``confirm``, that sender waits to
    hear whether it went out (``confirm_ok``). It goes out once every write in ``after`` is
    settled: a decode told ``failed`` or ``aborted`` may reuse the room's pages at once, so no
    byte may land in them after the status."""

    identity: bytes
    status: wire.Status
    confirm: NixlSender | None = None
    after: tuple[Write, ...] = ()


@dataclass(frozen=True, slots=True)
class Closed:
    """The sender is closed: its room leaves the tables. ``stuck`` holds its writes that are
    released but not yet settled (``poster.Write``), for the backend to reap (retry, then,
    when NIXL keeps refusing, drop the peer)."""

    sender: NixlSender
    stuck: tuple[Any, ...] = ()


SenderEvent = Tell | Closed


REFUSED_KEEP_S = 60.0  # how long a refused registration explains a room's missing handshake


@dataclass(frozen=True, slots=True)
class SendContext:
    """What all senders of one backend share. ``events`` is the backend's outbox: senders
    append, the backend drains (``NixlBackend.poll``). ``poster`` posts their writes (unset:
    inline over ``agent``)."""

    agent: Any  # nixl_agent
    local_lists: PreppedLists
    layout: KVLayout
    peer_timeout_s: float
    clock: Callable[[], float]
    events: list[SenderEvent] = field(default_factory=list)
    # Registrations refused lately (``transfer/refused_names.py``): the desk adds, senders read.
    refused: RefusedNames = field(default_factory=lambda: RefusedNames(REFUSED_KEEP_S))
    poster: WritePoster = None  # type: ignore[assignment]  # set below when not given

    def __post_init__(self) -> None:
        if self.poster is None:
            object.__setattr__(self, "poster", InlinePoster(self.agent))
