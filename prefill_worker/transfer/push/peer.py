"""A registered decode peer, as the push engine and the room tables see it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.headplan import HeadSlice
from prefill_worker.transfer.nixl.agent import PreppedLists
from prefill_worker.transfer.nixl.state_lists import StateLists


@dataclass(frozen=True, slots=True)
class RoutedWrite:
    """One write of a routed peer: descriptor indices into our page list and into the peer's
    KV list (``is_state`` False) or its state pool's list (``Peer.state``, True)."""

    local: np.ndarray
    remote: np.ndarray
    is_state: bool


class PageRoute(Protocol):
    """A peer whose pool takes our page regions in parts (SGLang's hybrid SWA pool: the full
    layers' into its KV list, the sliding layers' window pages into its state pool)."""

    def check(self, want: wire.Want, num_prompt_tokens: int) -> str | None:
        """Why the want cannot be served by this route, or None."""
        ...

    def writes(
        self,
        want: wire.Want,
        num_prompt_tokens: int,
        src: np.ndarray,
        dst: np.ndarray,
        first_page: int,
        sliding: np.ndarray | None = None,
    ) -> Sequence[RoutedWrite]:
        """The writes of our pages ``src`` (prompt pages from ``first_page`` on) whose KV-list
        pages are ``dst``; ``sliding``: the same prompt pages' entries in a windowed sliding
        pool (``kv.sliding``), None without one."""
        ...


@dataclass(eq=False)
class Peer:
    """A decode peer: its agent, its pool, its prepared descriptor lists. A protocol may
    extend it with what its dialect needs (where replies go, its metadata buffers)."""

    identity: bytes  # the hub's key: native, the ZMQ routing id; SGLang, the agent name
    agent_name: str
    regions: KVRegions
    lists: PreppedLists  # its pool's descriptor lists, prepared at registration
    last_seen: float
    rooms: set[int] = field(default_factory=set)  # open senders bound to this peer
    unmatched: set[int] = field(default_factory=set)  # rooms it wants, no request yet
    num_claimed_pages: int = 0  # pages those wants name (rooms.RoomBook keeps it)
    # A decode rank of TP > 1: its place, and the heads we write into it. ``lists.kv`` then
    # addresses token runs of those heads (``transfer.headplan``) unless the slice is whole.
    tp_rank: int = 0
    tp_size: int = 1
    head_slice: HeadSlice | None = None  # None: every head, whole pages (TP 1 on both sides)
    # A worker of TP > 1: whether this rank writes any heads into it (the aux row and the
    # status go to every rank all the same), and its `register`, for the other ranks.
    is_fed: bool = True
    registration: wire.Register | None = None
    # A model with state: the decode's state pool as it registered it, its list prepared
    # (None: it registered none, so its wants are refused ``state_unsupported``).
    state: StateLists | None = None
    # A decode rank that holds a share of each slot (SGLang's mamba pool at attention TP > 1):
    # the list of that share of our (staged) slots, its writes' source; None: whole slots
    # from the context's state pool.
    local_state: StateLists | None = None
    # A pool that takes our regions in parts (writes go where the route says); None: every
    # region of each page into ``lists.kv``.
    route: PageRoute | None = None


P = TypeVar("P", bound=Peer)  # a protocol's peer record
