"""One request's push into a decode peer: its writes in flight, its deadlines, its state.

Order of a successful push::

    send_pages × n   WRITE K,V of the chunk's pages into the pages the decode named (a
                     paged state component, a DSA model's index keys: its pages too, into
                     the same decode pages of its own pool, also into a decode rank whose
                     KV another rank of a TP group writes: every rank holds the same keys)
    send_aux         remembered; once no page write is in flight: the state slot's WRITE
                     (a model with state: every run of the request's slot into the decode's
                     ``dst_state_slot``; a rank holding a share of it, ``Peer.local_state``,
                     its share), and once that landed the dialect's aux WRITE
    aux landed       Tell(`ok`, confirm=sender); the hub sends it and calls
                     ``confirm_ok(delivered)``  ->  SUCCESS (or FAILED when unreachable)

A decode of tensor-parallel size d > 1 is d peers, one per rank, each with its own `want` for
the room: the room is READY once all d are bound; every write, the aux row and every status
then go to each rank, a rank's pages getting only its heads (``Peer.head_slice``, token runs
of ``transfer.headplan``); SUCCESS once every rank's `ok` went out.

A sender never calls back: what its hub must do (a ``Tell``, its ``Closed``) is appended to
``PushContext.events`` and done in order on the hub's next turn. ``close()`` never waits:
writes not yet settled go to the hub in ``Closed.stuck``. Every status waits (``Tell.after``)
until no byte of the room's writes can land (a ``failed`` or ``aborted`` also waits for those
``also_wait_for`` names: another rank's): a decode told ``failed`` or ``aborted`` reuses its
pages at once. A decode's abort ends the room ABORTED, acknowledged once no write is in
flight.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic

import numpy as np
from msgspec import UNSET

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.state_layout import PAGES
from prefill_worker.request import TransferStats
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.headplan import slice_indices
from prefill_worker.transfer.nixl.poster import Write, WritePoster
from prefill_worker.transfer.nixl.state_lists import StateLists
from prefill_worker.transfer.nixl.writes import WriteSet
from prefill_worker.transfer.pagemap import (
    check_want,
    check_want_state,
    map_pages,
    region_indices,
)
from prefill_worker.transfer.push.dialect import ABORTED_BY_DECODE, Dialect, PageLists
from prefill_worker.transfer.push.peer import P

STUCK_RELEASE_S = 0.5  # a handle NIXL refuses to release is retried this long, then its peer goes


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
    # A model with state: its state pool (the request's slot is its aux row), written whole
    # before the aux row into each decode's ``Peer.state``.
    state: StateLists | None = None
    # A draft model: our pool with the draft's layers after the target's
    # (``transfer.draft``), for decodes whose pool holds them too (``Peer.regions`` of more
    # layers than ``layout``): a chunk's pages go to both in one write.
    draft_pages: PageLists | None = None

    def pages_for(self, peer: P) -> PageLists:
        """The lists a peer's pages are written from (whole pages, or its heads' token runs
        in ``sliced``)."""
        return self.pages_into(peer.regions)

    def pages_into(self, remote: KVRegions) -> PageLists:
        """The lists our pages are written from into the decode pool ``remote``: with the
        draft's layers when it holds them too."""
        if remote.layout.num_layers == self.layout.num_layers:
            return self.pages
        assert self.draft_pages is not None, "a peer with draft layers and no draft"
        return self.draft_pages

    def layout_for(self, peer: P) -> KVLayout:
        """Our pool's layout as ``pages_for(peer)`` addresses it: the peer's layer count (the
        target's, or the target's and the draft's), our heads."""
        return dataclasses.replace(self.layout, num_layers=peer.regions.layout.num_layers)


class PushSender(Generic[P]):
    """KVSender; all progress happens in ``progress()``, called by the hub."""

    def __init__(
        self,
        ctx: PushContext[P],
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> None:
        self._ctx = ctx
        self.room, self.request_id = room, request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.allowed_peer = allowed_peer  # the only decode agent that may claim the room
        # the request's span, in every status (the decode continues the trace from it)
        self._traceparent = UNSET if traceparent is None else traceparent
        self.peers: list[P] = []  # the decode ranks bound, in order of their wants
        self.is_closed = False
        self._state = KVPoll.BOOTSTRAPPING
        self._reason: str | None = None
        self._wants: list[wire.Want] = []  # one per rank in ``peers``, once accepted
        self._num_ok_unconfirmed = 0  # `ok` Tells not yet confirmed delivered
        self._writes = WriteSet(ctx.write_timeout_s)
        self._aux_row: int | None = None
        self._is_state_posted = ctx.state is None  # nothing to post without state
        self._is_aux_posted = False
        self._is_ok_told = False  # `ok` handed to the hub, waiting for confirm_ok
        self._is_ack_due = False  # the peer aborted; acknowledge once no write is in flight
        self._ack_generation: int | None = None
        self._other_writes: tuple[Write, ...] = ()  # the room's writes made elsewhere
        self._index_s = 0.0  # building descriptor indices (engine thread)
        self._index_cpu_s = 0.0
        # A paged state component (a DSA model's index keys) goes with the pages: none at the end.
        self._has_paged_state = ctx.state is not None and ctx.state.regions.component.copy == PAGES
        self._is_state_posted = self._is_state_posted or self._has_paged_state

    # -- KVSender -----------------------------------------------------------------------

    def poll(self) -> KVPoll:
        return self._state

    def num_cached_tokens(self) -> int:
        return self._wants[0].num_cached_tokens if self._wants else 0

    @property
    def peer(self) -> P | None:
        """The first rank bound (the only one of a TP-1 decode), or None."""
        return self.peers[0] if self.peers else None

    def transfer_stats(self) -> TransferStats:
        """What landed: each DONE write (page runs and the aux row)."""
        return self._writes.stats()

    @property
    def prep_s(self) -> float:
        """Building descriptor indices and transfer requests (the finished ones)."""
        return self._index_s + self._writes.prep_s

    @property
    def prep_cpu_s(self) -> float:
        """The same in CPU time of the threads that did it."""
        return self._index_cpu_s + self._writes.prep_cpu_s

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        if self._state.is_terminal:
            return
        assert self._wants and self.peers, "send_pages before READY"
        self._state = KVPoll.TRANSFERRING
        num_cached_pages = self.num_cached_tokens() // self._ctx.layout.page_size
        for peer, want in zip(self.peers, self._wants, strict=True):
            try:
                src, dst = map_pages(page_ids, first_page, num_cached_pages, want.dst_page_ids)
            except ValueError as exc:
                return self.fail(str(exc))
            if not len(src):
                continue
            if peer.is_fed and peer.route is None:
                self._post_pages(peer, src, dst)
            elif peer.is_fed:  # prompt page of src[0]: after the pages the decode holds
                sliding = None
                if sliding_page_ids:  # a windowed sliding pool's entries of the same pages
                    sliding = np.asarray(sliding_page_ids[len(page_ids) - len(src) :], np.int64)
                self._post_routed(
                    peer, want, src, dst, first_page + len(page_ids) - len(src), sliding
                )
            if self._has_paged_state:  # into every decode rank, whoever writes its KV
                self._post_state_pages(peer, src, dst)

    def send_aux(self, aux_row: int) -> None:
        if not self._state.is_terminal:
            assert self._wants, "send_aux before READY"
            self._state, self._aux_row = KVPoll.TRANSFERRING, aux_row

    def fail(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.FAILED, reason
            self._tell("failed", reason)

    def failure_reason(self) -> str | None:
        return self._reason

    def why_no_handshake(self) -> str | None:
        return self._ctx.dialect.why_no_handshake()

    def close(self) -> None:
        """Never waits: writes in flight are cancelled (released); those not settled yet go
        to the hub with the ``Closed`` event."""
        if self.is_closed:
            return
        self.fail("the request ended before its transfer")
        self._writes.release_all()
        self._maybe_ack()
        self.is_closed = True
        self._ctx.events.append(Closed(self, self._writes.unsettled()))

    # -- driven by the hub --------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self._writes)

    @property
    def needs_progress(self) -> bool:
        """True while ``progress()`` has something to watch: writes in flight, an aux row
        to post, an acknowledgement due. NIXL gives no fd to wait on, so this means polling."""
        is_aux_due = self._state is KVPoll.TRANSFERRING and self._aux_row is not None
        return bool(self._writes) or (is_aux_due and not self._is_ok_told) or self._is_ack_due

    def bound(self) -> list[tuple[P, wire.Want]]:
        """Each decode rank bound, with its `want`, in order (every one, once READY)."""
        return list(zip(self.peers, self._wants, strict=True))

    def also_wait_for(self, writes: Write) -> None:
        """Writes of this room made elsewhere (a tensor-parallel follower's): a ``failed``
        or ``aborted`` status waits for them as for this sender's own."""
        self._other_writes += (writes,)

    def accepts(self, agent_name: str) -> bool:
        """May this decode agent claim the room (the router may have named one)?"""
        return self.allowed_peer is None or self.allowed_peer == agent_name

    def accepts_rank(self, peer: P) -> bool:
        """May ``peer`` bind: the first rank an accepted agent, a later one another rank of
        the same decode TP group (its size, a rank not bound yet)."""
        if not self.peers:
            return self.accepts(peer.agent_name)
        first = self.peers[0]
        ranks = {p.tp_rank for p in self.peers}
        is_sibling = peer.tp_size == first.tp_size > len(self.peers)
        return is_sibling and peer not in self.peers and peer.tp_rank not in ranks

    @property
    def num_ranks(self) -> int:
        """How many decode ranks must bind before the room is READY."""
        return self.peers[0].tp_size if self.peers else 1

    def bind(self, peer: P, want: wire.Want) -> None:
        """The peer's `want` for this room (its desk checked what the protocol asks beyond
        pages): READY once every rank of the decode bound, or FAILED with the reason.
        Statuses go to the bound ranks from now on."""
        self.peers.append(peer)
        if self._state.is_terminal:  # failed before the want came: tell the peer now
            self._tell("failed", self._reason, only=peer)
            return
        reason = check_want(want, self.num_prompt_tokens, self._ctx.layout, peer.regions)
        if reason is None:
            state = self._ctx.state
            local = None if state is None else state.regions.component
            remote = None if peer.state is None else peer.state.regions
            reason = check_want_state(want, local, remote)
        if reason is None and peer.route is not None:
            reason = peer.route.check(want, self.num_prompt_tokens)
        if reason is None and self._wants and want.num_cached_tokens != self.num_cached_tokens():
            reason = "the decode ranks' wants differ in num_cached_tokens"
        if reason is not None:
            return self.fail(reason)
        self._wants.append(want)
        if self._state is KVPoll.BOOTSTRAPPING and len(self._wants) == self.num_ranks:
            self._state = KVPoll.READY

    def abort_by_peer(self, generation: int | None = None, *, is_ack_due: bool = True) -> None:
        """The peer aborted the room: ABORTED; acknowledged once no write targets its pages
        (not when the abort came before the request: it was acknowledged then)."""
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.ABORTED, ABORTED_BY_DECODE
        if is_ack_due:
            self._is_ack_due, self._ack_generation = True, generation
            self._maybe_ack()

    def lose_peer(self, reason: str, peer: P | None = None) -> None:
        """A bound rank (``peer``; None: every one) is gone (silent, left, evicted, or the
        worker is closing): PEER_LOST, every write cancelled. Every rank is told too, the
        lost one in case it can still hear; the others stay bound (written no more)."""
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.PEER_LOST, reason
            self._tell("failed", reason)
        self._is_ack_due = False
        self._writes.release_all()  # its peer is being dropped: nothing else would end them
        if peer is None:
            self.peers, self._wants = [], []
            return
        index = self.peers.index(peer)
        del self.peers[index]
        del self._wants[index : index + 1]

    def progress(self) -> None:
        why = self._writes.check(self._ctx.clock())
        if why is not None:
            self.fail(why)
        is_aux_due = self._state is KVPoll.TRANSFERRING and self._aux_row is not None
        if is_aux_due and not self._writes and not self._is_ok_told:
            if not self._is_state_posted:
                self._post_state()
            elif not self._is_aux_posted:
                self._post_aux()
            else:
                self._is_ok_told, self._num_ok_unconfirmed = True, len(self.peers)
                self._tell("ok", None, confirm=True)
        self._maybe_ack()

    def confirm_ok(self, is_delivered: bool) -> None:
        """The hub's answer to the `ok` Tell: SUCCESS, or FAILED if it could not be sent."""
        if self._state is not KVPoll.TRANSFERRING:
            return
        if not is_delivered:
            return self.fail(self._ctx.dialect.unreachable)
        self._num_ok_unconfirmed -= 1
        if self._num_ok_unconfirmed <= 0:
            self._state = KVPoll.SUCCESS

    # -- internals ----------------------------------------------------------------------

    def _tell(
        self,
        code: wire.StatusCode,
        reason: str | None,
        confirm: bool = False,
        only: P | None = None,
    ) -> None:
        """The status to every bound rank (or ``only`` that one). No rank yet: a `want` that
        comes later learns the reason (bind)."""
        status = wire.Status(self.room, code, reason, traceparent=self._traceparent)
        confirming = self if confirm else None
        generation = self._ack_generation if code == "aborted" else None
        after = self._writes.pending()
        if code != "ok":  # an `ok` follows the aux row, which follows every rank's writes
            after += self._other_writes
        for peer in self.peers if only is None else [only]:
            tell = Tell(peer, status, confirming, after, generation)
            self._ctx.events.append(tell)

    def _post_pages(self, peer: P, src: np.ndarray, dst: np.ndarray) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        # a draft's layers too, when the peer holds them
        pages, head_slice = self._ctx.pages_for(peer), peer.head_slice
        if head_slice is None:  # whole pages
            local = region_indices(src, pages.num_regions, self._ctx.layout.num_pages)
            remote = region_indices(dst, pages.num_regions, peer.regions.layout.num_pages)
            local_list, num_bytes = pages.local, len(local) * pages.region_bytes
        else:  # this rank's heads of every token
            local = slice_indices(src, self._ctx.layout_for(peer))
            remote = slice_indices(dst, peer.regions.layout)
            local_list = pages.sliced[(head_slice.src_head_offset, head_slice.num_heads)]
            num_bytes = len(local) * head_slice.num_heads * pages.head_bytes
        self._index_s += time.perf_counter() - start
        self._index_cpu_s += time.thread_time() - start_cpu
        write = self._ctx.poster.post(local_list, local, peer.lists.kv, remote, b"", num_bytes)
        self._writes.add(write, self._ctx.clock())

    def _post_state_pages(self, peer: P, src: np.ndarray, dst: np.ndarray) -> None:
        """A paged component's pages (a DSA model's index keys) into the decode's pages the
        chunk's KV went to, in the component's pool: one write with the chunk's."""
        state = self._ctx.state
        assert state is not None and peer.state is not None
        local, remote = state.page_indices(src), peer.state.page_indices(dst)
        num_bytes = len(src) * state.regions.component.slot_bytes
        write = self._ctx.poster.post(
            state.prepped, local, peer.state.prepped, remote, b"", num_bytes
        )
        self._writes.add(write, self._ctx.clock())

    def _post_routed(
        self,
        peer: P,
        want: wire.Want,
        src: np.ndarray,
        dst: np.ndarray,
        first_page: int,
        sliding: np.ndarray | None,
    ) -> None:
        """Each part of the pages where the peer's route sends it: whole pages, or the
        token runs of its head slice (the route's indices then address those lists)."""
        assert peer.route is not None
        try:
            parts = peer.route.writes(want, self.num_prompt_tokens, src, dst, first_page, sliding)
        except ValueError as exc:
            return self.fail(str(exc))
        pages, head_slice = self._ctx.pages, peer.head_slice
        local_list, desc_bytes = pages.local, pages.region_bytes
        if head_slice is not None:
            local_list = pages.sliced[(head_slice.src_head_offset, head_slice.num_heads)]
            desc_bytes = head_slice.num_heads * pages.head_bytes
        for part in parts:
            if not len(part.local):
                continue
            if part.is_state:
                assert peer.state is not None, "a route into a state pool the peer lacks"
                remote_list = peer.state.prepped
            else:
                remote_list = peer.lists.kv
            num_bytes = len(part.local) * desc_bytes
            write = self._ctx.poster.post(
                local_list, part.local, remote_list, part.remote, b"", num_bytes
            )
            self._writes.add(write, self._ctx.clock())

    def _post_state(self) -> None:
        """The request's state slot (its aux row), whole, into each decode's slot; the aux
        row follows once it landed, so the room's notification means the state is there."""
        assert self._ctx.state is not None and self._aux_row is not None
        self._is_state_posted = True
        for peer, want in zip(self.peers, self._wants, strict=True):
            assert peer.state is not None and isinstance(want.dst_state_slot, int)
            state = peer.local_state or self._ctx.state  # a rank's share, or whole slots
            local, remote = state.indices(self._aux_row), peer.state.indices(want.dst_state_slot)
            num_bytes = state.regions.component.slot_bytes
            write = self._ctx.poster.post(
                state.prepped, local, peer.state.prepped, remote, b"", num_bytes
            )
            self._writes.add(write, self._ctx.clock())

    def _post_aux(self) -> None:
        assert self.peers and self._aux_row is not None
        self._is_aux_posted = True
        for peer, want in zip(self.peers, self._wants, strict=True):
            write = self._ctx.dialect.post_aux(peer, want, self.room, self._aux_row)
            self._writes.add(write, self._ctx.clock())

    def _maybe_ack(self) -> None:
        if self._is_ack_due and not self._writes:
            self._is_ack_due = False
            self._tell("aborted", ABORTED_BY_DECODE)
