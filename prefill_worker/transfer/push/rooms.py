"""Rooms the worker knows without an open sender: wants that came before their request
(claims), rooms whose request ended before any want (gone, so a late want learns why), and
rooms a decode aborted before their request came (aborted, so the late request ends at once
instead of waiting out its bootstrap timeout).

Bounded: at most ``max_claims_per_room`` peers wait on one room, or as many as the claiming
decode has ranks when it has more (each rank of a decode of TP d wants the room); at most
``max_claims_per_peer`` rooms wait for one peer, naming together no more pages than its pool
has (a decode cannot use more at once), so what a peer can park here is bounded by its own
registration. Each claim is in two indexes, the room's list and its peer's ``unmatched`` set;
``check_integrity`` says they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

from prefill_worker.transfer import wire
from prefill_worker.transfer.push.peer import P
from prefill_worker.transfer.validate import Refusal, RejectReason, duplicate_want


@dataclass(slots=True)
class Claim(Generic[P]):
    """A `want` that came before its room's request."""

    peer: P
    want: wire.Want
    deadline: float


@dataclass(frozen=True, slots=True)
class Gone:
    """A room whose request ended unbound."""

    reason: str
    allowed_peer: str | None
    forget_at: float


@dataclass(frozen=True, slots=True)
class Aborted:
    """A room its decode aborted before the room's request came."""

    agent_name: str
    forget_at: float


class RoomBook(Generic[P]):
    """Claims by room and rooms gone; no NIXL, no sockets."""

    def __init__(self, max_claims_per_room: int, max_claims_per_peer: int) -> None:
        self._max_per_room, self._max_per_peer = max_claims_per_room, max_claims_per_peer
        self._claims: dict[int, list[Claim[P]]] = {}
        self._gone: dict[int, Gone] = {}
        self._aborted: dict[int, Aborted] = {}

    def num_claims(self, room: int) -> int:
        return len(self._claims.get(room, ()))

    def claim(self, peer: P, want: wire.Want, deadline: float) -> Refusal | None:
        """Remember the want until its request comes, or say why not."""
        claims = self._claims.get(want.room, [])
        room_bound = max(self._max_per_room, peer.tp_size)  # every rank of one decode
        if any(c.peer is peer for c in claims) or len(claims) >= room_bound:
            return duplicate_want(want.room)
        if len(peer.unmatched) >= self._max_per_peer:
            why = f"{len(peer.unmatched)} wants already wait for their requests"
            return Refusal(RejectReason.TOO_MANY_WANTS, why)
        num_pages = peer.num_claimed_pages + want.num_dst_pages
        if num_pages > peer.regions.layout.num_pages:
            why = (
                f"wants waiting for their requests would name {num_pages} pages; "
                f"the decode pool has {peer.regions.layout.num_pages}"
            )
            return Refusal(RejectReason.TOO_MANY_WANTS, why)
        self._claims.setdefault(want.room, []).append(Claim(peer, want, deadline))
        peer.unmatched.add(want.room)
        peer.num_claimed_pages = num_pages
        return None

    def take(self, room: int) -> list[Claim[P]]:
        """Every claim on the room, in arrival order; the room's request has come."""
        claims = self._claims.pop(room, [])
        for claim in claims:
            claim.peer.unmatched.discard(room)
            claim.peer.num_claimed_pages -= claim.want.num_dst_pages
        self._gone.pop(room, None)
        return claims

    def drop(self, room: int, peer: P) -> bool:
        """Forget the peer's claim on the room; True if it had one."""
        claims = self._claims.get(room, [])
        kept = [c for c in claims if c.peer is not peer]
        if kept:
            self._claims[room] = kept
        else:
            self._claims.pop(room, None)
        peer.unmatched.discard(room)
        peer.num_claimed_pages -= sum(c.want.num_dst_pages for c in claims if c.peer is peer)
        return len(kept) != len(claims)

    def next_deadline(self) -> float | None:
        """When the first waiting `want` expires, if any waits."""
        return min((c.deadline for cs in self._claims.values() for c in cs), default=None)

    def pop_expired(self, now: float) -> list[Claim[P]]:
        claims = [c for cs in self._claims.values() for c in cs]
        expired = [c for c in claims if now >= c.deadline]
        for claim in expired:
            self.drop(claim.want.room, claim.peer)
        self._gone = {r: g for r, g in self._gone.items() if now < g.forget_at}
        self._aborted = {r: a for r, a in self._aborted.items() if now < a.forget_at}
        return expired

    def mark_aborted(self, room: int, agent_name: str, forget_at: float) -> None:
        """The decode withdrew its claim on the room: its request, if it comes, ends then."""
        self._aborted[room] = Aborted(agent_name, forget_at)

    def take_aborted(self, room: int) -> str | None:
        """The agent that aborted the room before its request came, if one did."""
        aborted = self._aborted.pop(room, None)
        return None if aborted is None else aborted.agent_name

    def mark_gone(self, room: int, gone: Gone) -> None:
        self._gone[room] = gone

    def gone(self, room: int) -> Gone | None:
        return self._gone.get(room)

    def forget_gone(self, room: int) -> None:
        self._gone.pop(room, None)

    def check_integrity(self, peers: list[P]) -> None:
        for room, claims in self._claims.items():
            assert claims and all(room in c.peer.unmatched for c in claims)
        for peer in peers:
            mine = [c for r in peer.unmatched for c in self._claims[r] if c.peer is peer]
            assert len(mine) == len(peer.unmatched)
            assert peer.num_claimed_pages == sum(c.want.num_dst_pages for c in mine)
