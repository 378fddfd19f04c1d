"""What a NIXL backend and its senders share: the decode peer record, the send context, and
the events senders leave in it for the backend.

A sender never calls back: what the backend must do (a status for a peer, forgetting a closed
sender, reaping handles NIXL would not release) is appended to ``SendContext.events`` and done
by the backend, in order, when it drains them on its next ``poll()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.agent import PreppedLists

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
    hear whether it went out (``confirm_ok``)."""

    identity: bytes
    status: wire.Status
    confirm: NixlSender | None = None


@dataclass(frozen=True, slots=True)
class Closed:
    """The sender is closed: its room leaves the tables. ``stuck`` holds write handles NIXL
    would not release, for the backend to reap (retry, then drop the peer)."""

    sender: NixlSender
    stuck: tuple[Any, ...] = ()


SenderEvent = Tell | Closed


@dataclass(frozen=True, slots=True)
class SendContext:
    """What all senders of one backend share. ``events`` is the backend's outbox: senders
    append, the backend drains (``NixlBackend.poll``)."""

    agent: Any  # nixl_agent
    local_lists: PreppedLists
    layout: KVLayout
    peer_timeout_s: float
    clock: Callable[[], float]
    events: list[SenderEvent] = field(default_factory=list)
