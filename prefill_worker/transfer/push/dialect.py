"""What a protocol tells the push engine: how a status, an abort acknowledgement and an aux
row are written (``Dialect``); and what a sender leaves for its hub (``Tell``, ``Closed``) in
the ``PushContext`` all senders of one hub share.

A sender never calls back: what the hub must do is appended to ``PushContext.events`` and
done, in order, on the hub's next turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from prefill_worker.kv.layout import KVLayout
from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.poster import Write, WritePoster
from prefill_worker.transfer.push.peer import P, Peer

if TYPE_CHECKING:
    from prefill_worker.transfer.push.sender import PushSender

P_contra = TypeVar("P_contra", bound=Peer, contravariant=True)

ABORTED_BY_DECODE = "aborted by decode"


class Dialect(Protocol[P_contra]):
    """One protocol's way of saying things to a decode peer."""

    @property
    def unreachable(self) -> str:
        """Why a request fails when its `ok` could not be sent."""
        ...

    def send(self, peer: P_contra, status: wire.Status, generation: int | None = None) -> bool:
        """Write ``status`` for the peer, as this protocol does (an ``aborted`` status is the
        acknowledgement of the peer's abort, ``generation`` what that abort carried); False
        when it could not be sent."""
        ...

    def dropped(self, room: int, reason: str) -> wire.Status:
        """What a room the peer wanted, with no request yet, hears when the peer is dropped."""
        ...

    def post_aux(self, peer: P_contra, want: wire.Want, room: int, aux_row: int) -> Write:
        """Queue the WRITE of the engine's aux row ``aux_row`` into the peer's slot."""
        ...

    def why_no_handshake(self) -> str | None:
        """A likely reason no decode has claimed a waiting room yet, or None."""
        ...


@dataclass(frozen=True, slots=True)
class Tell(Generic[P]):
    """A status for ``peer``; with ``confirm``, that sender waits to hear whether it went out
    (``confirm_ok``). It goes out once every write in ``after`` is settled: a decode told
    ``failed`` or ``aborted`` may reuse the room's pages at once, so no byte may land in them
    after the status."""

    peer: P
    status: wire.Status
    confirm: PushSender[P] | None = None
    after: tuple[Write, ...] = ()
    generation: int | None = None  # what the abort carried, for its acknowledgement


@dataclass(frozen=True, slots=True)
class Closed(Generic[P]):
    """The sender is closed: its room leaves the tables. ``stuck`` holds its writes released
    but not yet settled, for the hub's reaper (retry, then, when NIXL keeps refusing, drop
    the peer)."""

    sender: PushSender[P]
    stuck: tuple[Write, ...] = ()


@dataclass(frozen=True, slots=True)
class PageLists:
    """Our pool as page writes address it: the prepared list, its regions per page (2L for a
    per-layer list, 1 for a page-major one) and the bytes of one region of one page."""

    local: Any  # nixl prepped descriptor list
    num_regions: int
    region_bytes: int


@dataclass(frozen=True, slots=True)
class PushContext(Generic[P]):
    """What all senders of one hub share. ``events`` is the hub's outbox: senders append,
    the hub drains."""

    poster: WritePoster  # where the agent lives (the transfer thread, or inline)
    pages: PageLists
    layout: KVLayout
    dialect: Dialect[P]
    write_timeout_s: float  # a write in flight this long fails its request
    clock: Callable[[], float]
    events: list[Tell[P] | Closed[P]] = field(default_factory=list)
