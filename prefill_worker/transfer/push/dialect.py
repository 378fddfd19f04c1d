"""What a protocol tells the push engine: how a status, an abort acknowledgement and an aux
row are written (``Dialect``), and how its pool is addressed by page writes (``PageLists``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.poster import Write
from prefill_worker.transfer.push.peer import Peer

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
class PageLists:
    """Our pool as page writes address it: the prepared list, its regions per page (2L for a
    per-layer list, 1 for a page-major one) and the bytes of one region of one page. For
    decode ranks that hold a sub-range of our heads, token-run lists of those heads
    (``transfer.headplan.slice_table``) by (head offset, heads), prepared when a rank that
    needs one registers; ``head_bytes`` is one head of one token."""

    local: Any  # nixl prepped descriptor list
    num_regions: int
    region_bytes: int
    head_bytes: int = 0
    sliced: dict[tuple[int, int], Any] = field(default_factory=dict)

    def release_sliced(self) -> None:
        for lists in self.sliced.values():
            lists.release()
        self.sliced.clear()
