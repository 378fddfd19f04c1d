"""A follower rank's transfer backend: its own NIXL agent over its own pool (its KV heads),
writing its head slices into the decode ranks the leader admitted, as the leader's mirror
says (``tp/mirror.py``). It serves no protocol: decodes register with the leader only; the
leader's `register` of each decode rank reaches this rank (``add_peer``), and so does each
room's binding (``RankSender.bind``: the decode ranks' `want`s) before its pages::

    mirror op   create      a RankSender, READY (its pages wait for their bind)
                peer        add_peer(register): the decode rank's agent and pool, this
                            rank's slice of it (``RankWriter``; none: not fed here), and
                            its hybrid SWA pool when the register names one (SGLang's)
                bind        the room's decode ranks and their wants
                pages       one WRITE per fed decode rank of this rank's heads  TRANSFERRING
                            (and one of the window's pages into its hybrid SWA pool:
                            ``swa_window.window_slots`` of its want, a ``WindowWant``)
                aux         every page sent: SUCCESS once every write landed
                fail/close  FAILED; writes in flight released (cancelled)
                drop        the decode rank left the leader: its rooms FAILED (their
                            writes released), its agent forgotten once no write to it
                            can land (``drop_peer``; a refused release retried first)

The aux row and the status are the leader's (sent once every rank's SUCCESS is agreed);
this rank's SUCCESS says only "my writes landed". A write NIXL refuses or reports failed
fails the room (FAILED, agreed by the group); one still in flight past ``write_timeout_s``
too. A failed room releases its writes in flight; ``settle`` says when none can land any more
(a release NIXL refuses is retried), for the leader's failure status.

A write that landed (DONE) counts its bytes (what its descriptors cover) twice: for its room
(``written_bytes``, and the debug line the rank logs when the room closes: its writes posted
and the bytes landed) and for the backend (``take_written_bytes``: what landed since the last
call, which the follower reports to the leader in its step answer, ``tp/channel.py``, for the
group's ``prefill_worker_transfer_bytes_total`` and this rank's
``prefill_worker_tp_write_bytes_total``). A rank writes nothing for a room whose decode ranks
the head plan gives to other ranks (an MLA latent into a decode of TP 1: rank 0 alone).

A windowed sliding pool (``cache.sliding_pool``; ``sliding``) is written as the leader's
push writes it (``push.window_route.FullPoolWindow``, whole pages or this rank's head slice
in token runs): full layers whole, each sliding layer's window from the room's sliding
pages, which the ``pages`` op carries (every rank holds the same sliding pages: the step's
plan names them). Torch-free; importing it imports NIXL.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from msgspec import UNSET

from prefill_worker.kv.layout import KVRegions
from prefill_worker.request import TransferStats
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.draft import pool_into, with_draft_layers
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS, mem_type, region_tables
from prefill_worker.transfer.nixl.rank_writer import RankPlace, RankWriter, WindowPool
from prefill_worker.transfer.pagemap import map_pages, num_prompt_pages
from prefill_worker.transfer.push.window_route import FullPoolWindow, chunk_writes, full_pool_route
from prefill_worker.transfer.swa_window import (
    SWA_KIND,
    SlidingLayers,
    WindowWant,
    swa_pool_regions,
    window_slots,
)

log = logging.getLogger(__name__)
_WRITE_ERRORS: tuple[type[Exception], ...] = (ValueError, RuntimeError, *NIXL_ERRORS)


@dataclass(frozen=True, slots=True)
class _DecodeRank:
    """A decode rank this rank knows: its agent name as registered, its writer (one per
    decode agent, so a re-registration replaces it whole), and the name it writes under
    (None: this rank feeds it nothing)."""

    agent_name: str
    writer: RankWriter
    name: str | None
    route: FullPoolWindow | None = None  # a windowed sliding pool's pages into its pool


class RankSender:
    """One room on this rank (the module docstring's states)."""

    def __init__(self, backend: RankBackend, room: int, num_prompt_tokens: int = 0) -> None:
        self._backend, self.room, self._num_prompt_tokens = backend, room, num_prompt_tokens
        self._num_prompt_pages = num_prompt_pages(max(num_prompt_tokens, 1), backend.page_size)
        self._state = KVPoll.READY
        self._reason: str | None = None
        self._targets: list[tuple[_DecodeRank, wire.Want]] = []
        self._handles: list[tuple[Any, float, int, RankWriter]] = []  # (.., posted at, bytes)
        self._is_last = False  # the aux op came: no more pages
        self._num_writes = 0  # KV writes this rank posted for the room
        self._written_bytes = 0  # ... and the bytes of those that landed

    def bind(self, agent_names: Sequence[str], wants: Sequence[wire.Want]) -> None:
        ranks = self._backend.decode_ranks
        try:
            self._targets = [(ranks[n], w) for n, w in zip(agent_names, wants, strict=True)]
        except KeyError as exc:
            self.fail(f"decode agent {exc} unknown on this rank")

    def poll(self) -> KVPoll:
        if self._state.is_terminal:
            return self._state
        self._check_writes()
        if self._is_last and not self._handles and not self._state.is_terminal:
            self._state = KVPoll.SUCCESS
        return self._state

    def num_cached_tokens(self) -> int:
        return self._targets[0][1].num_cached_tokens if self._targets else 0

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        if self._state.is_terminal:
            return
        self._state = KVPoll.TRANSFERRING
        num_cached_pages = self.num_cached_tokens() // self._backend.page_size
        for rank, want in self._targets:
            if rank.name is None:
                continue
            if self._backend.decode_ranks.get(rank.agent_name) is not rank:
                # The name registered again (its old writer closed): this room's pages were
                # the old registration's.
                return self.fail(f"decode agent {rank.agent_name} registered again")
            try:
                src, dst = map_pages(page_ids, first_page, num_cached_pages, want.dst_page_ids)
                if len(src):
                    self._post(rank, want, src, dst, (page_ids, first_page, sliding_page_ids))
                if isinstance(want, WindowWant):  # the window's pages into its SWA pool too
                    first = first_page + len(page_ids) - len(src)
                    window, pages = want.dst_window_pages, self._num_prompt_pages
                    kept, slots = window_slots(window, pages, first, len(src))
                    if len(slots):
                        self._post(rank, want, src[kept], slots, None)
            except _WRITE_ERRORS as exc:
                return self.fail(f"tensor-parallel rank {self._backend.place.rank}: {exc}")

    def _post(
        self,
        rank: _DecodeRank,
        want: wire.Want,
        src: np.ndarray,
        dst: np.ndarray,
        chunk: tuple[Sequence[int], int, Sequence[int]] | None,
    ) -> None:
        """One WRITE of this rank's slice of ``src`` into ``dst``: every region, or where the
        decode rank's route sends each (``ValueError`` for a window page not given); no
        ``chunk``: the window's pages into the decode rank's hybrid SWA pool."""
        assert rank.name is not None
        if chunk is None or rank.route is None:
            handle, num_bytes = rank.writer.post(rank.name, src, dst, b"", window=chunk is None)
        else:
            parts = chunk_writes(rank.route, want, self._num_prompt_tokens, chunk, src, dst)
            local = np.concatenate([part.local for part in parts])
            remote = np.concatenate([part.remote for part in parts])
            handle, num_bytes = rank.writer.post_indices(rank.name, local, remote, b"")
        self._backend.count_posted(rank.writer)
        self._handles.append((handle, self._backend.clock(), num_bytes, rank.writer))
        self._num_writes += 1

    def send_aux(self, aux_row: int) -> None:
        self._is_last = True

    def fail(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.FAILED, reason
            log.warning("room %d failed on this rank: %s", self.room, reason)
        self._release()

    def lose_peer(self, agent_name: str) -> None:
        """The decode rank ``agent_name`` left: a room bound to it fails
        (``mirror.LosingPeers``)."""
        if any(rank.agent_name == agent_name for rank, _ in self._targets):
            self.fail(f"decode agent {agent_name} left")

    def settle(self) -> bool:
        """No write of the room can land from this rank any more (``mirror.ReplayedSender``)."""
        if self._state.is_terminal:
            self._release()
        return not self._handles

    def failure_reason(self) -> str | None:
        return self._reason

    def why_no_handshake(self) -> str | None:
        return None

    def transfer_stats(self) -> TransferStats:
        """The bytes of this rank's writes of the room that landed."""
        return TransferStats(self._written_bytes)

    def close(self) -> None:
        self.fail("the request ended before its transfer")
        log.debug(
            "rank %d: room %d ended %s, %d KV writes posted, %d bytes landed",
            self._backend.place.rank,
            self.room,
            self._state.name,
            self._num_writes,
            self._written_bytes,
        )

    def _release(self) -> None:
        """Release every write still held (cancelling it); keep those NIXL refused."""
        self._handles = [w for w in self._handles if not self._backend.release(w[0], w[3])]

    def _check_writes(self) -> None:
        agent, now, pending, why = self._backend.agent, self._backend.clock(), [], None
        for handle, posted_at, num_bytes, writer in self._handles:
            state = agent.check_xfer_state(handle)
            if state == "DONE":
                self._written_bytes += num_bytes
                self._backend.count_written(num_bytes)
            if state in ("DONE", "ERR"):  # over: nothing more of it can land
                self._backend.finish(handle, writer)
                why = why or (
                    None if state == "DONE" else "a KV write failed on a tensor-parallel rank"
                )
            else:
                pending.append((handle, posted_at, num_bytes, writer))
                if now - posted_at > self._backend.write_timeout_s:
                    why = (
                        why or f"a KV write was in flight over {self._backend.write_timeout_s:g} s"
                    )
        self._handles = pending
        if why is not None:
            self.fail(why)


class RankBackend:
    """A follower's backend (module docstring). Used on the follower's step loop only."""

    def __init__(
        self,
        agent: Any,  # nixl_agent, owned here from now on
        place: RankPlace,
        regions: KVRegions,
        write_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        draft: KVRegions | None = None,
        sliding: SlidingLayers | None = None,
    ) -> None:
        """``draft``: this rank's draft pool (``model.draft``), written with the target's
        pages into a decode rank that registered a draft pool (its layers after the
        target's, ``transfer.draft.with_draft_layers``); any other gets the target's.
        ``sliding``: a windowed sliding pool's layers (``pool_pages`` > 0; the module
        docstring), None or 0 without one."""
        self.agent, self.place, self._regions, self._draft = agent, place, regions, draft
        self._sliding = sliding
        both = regions if draft is None else with_draft_layers(regions, draft)
        self.write_timeout_s, self.clock = write_timeout_s, clock
        self.page_size = regions.layout.page_size
        kv_table, _ = region_tables(both)  # the KV pools only: the aux rows are the leader's
        self._registration = agent.register_memory(kv_table, mem_type(regions.device))
        self._ranks: dict[str, _DecodeRank] = {}
        self._leaving: dict[str, _DecodeRank] = {}  # dropped, a write to it may still land
        self._writes: Counter[RankWriter] = Counter()  # writes that may still land, by writer
        self._written_bytes = 0  # landed since the last ``take_written_bytes``

    @property
    def decode_ranks(self) -> Mapping[str, _DecodeRank]:
        return self._ranks

    def add_peer(self, msg: wire.Register) -> None:
        """A decode rank the leader admitted (again: its old writer goes first, a leaving one
        too, whatever it still writes: the agent name is the new one's now)."""
        for old in (self._ranks.pop(msg.agent_name, None), self._leaving.pop(msg.agent_name, None)):
            if old is not None:
                old.writer.close()
                del self._writes[old.writer]
        dst_rank, dst_tp = (0, 1) if msg.tp is UNSET else (msg.tp.tp_rank, msg.tp.tp_size)
        try:
            theirs = self._decode_pool(msg)
            ours = pool_into(self._regions, self._draft, theirs)
        except ValueError as exc:  # the leader checked it; its rooms' binds fail
            log.error("decode agent %s not added on this rank: %s", msg.agent_name, exc)
            return
        writer = RankWriter(self.agent, self.place, ours)
        try:
            metadata = wire.unframe_metadata(msg.metadata)
            name = writer.add_peer(metadata, theirs, dst_rank, dst_tp, _window_pool(msg))
        except _WRITE_ERRORS as exc:  # the leader checked it; its rooms' binds fail
            log.error("decode agent %s not added on this rank: %s", msg.agent_name, exc)
            writer.close()
            return
        self._ranks[msg.agent_name] = _DecodeRank(
            msg.agent_name, writer, name, self._route(writer, theirs, dst_rank, dst_tp)
        )

    def _route(
        self, writer: RankWriter, theirs: KVRegions, dst_rank: int, dst_tp: int
    ) -> FullPoolWindow | None:
        """A windowed sliding pool's route into the decode rank (None: no windowed pool, or
        this rank feeds it nothing)."""
        head_slice = writer.slice_for(dst_rank, dst_tp)
        if head_slice is None:
            return None
        ours, is_whole = self._regions.layout, head_slice.is_whole_page
        return full_pool_route(
            self._sliding, ours.num_pages, theirs.layout.num_pages, self.page_size, is_whole
        )

    def _decode_pool(self, msg: wire.Register) -> KVRegions:
        """The decode rank's pool as this rank writes it: with its draft pool's layers after
        the target's when it registered one (a native `register` names it apart; SGLang's,
        carried as a native one, has them among its regions already) and this rank has a
        draft (the leader admitted the decode for this draft, ``native.draft``)."""
        if self._draft is None or msg.draft is UNSET:
            return msg.regions
        return with_draft_layers(msg.regions, msg.draft.regions(msg.regions))

    def drop_peer(self, agent_name: str) -> None:
        """The leader dropped the decode rank (its senders lost it first, releasing their
        writes): its agent and lists go now, or at the ``poll`` after its last write was
        released (an unknown name: nothing)."""
        rank = self._ranks.pop(agent_name, None)
        if rank is not None:
            self._leaving[agent_name] = rank
            self._forget_left()

    @property
    def num_peers(self) -> int:
        """The decode ranks this rank holds a writer for, leaving ones included."""
        return len(self._ranks) + len(self._leaving)

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> RankSender:
        return RankSender(self, room, num_prompt_tokens)

    def count_posted(self, writer: RankWriter) -> None:
        """A write through ``writer`` was posted: it may land until released or over."""
        self._writes[writer] += 1

    def release(self, handle: Any, writer: RankWriter) -> bool:
        """Release a write handle (cancelling it if in flight); False when NIXL refused."""
        try:
            self.agent.release_xfer_handle(handle)
        except NIXL_ERRORS as exc:
            log.warning("releasing a write handle: %s", exc)
            return False
        self._uncount(writer)
        return True

    def finish(self, handle: Any, writer: RankWriter) -> None:
        """A write that is over (landed or failed): nothing of it can land any more, whether
        NIXL releases its handle or not."""
        if not self.release(handle, writer):
            self._uncount(writer)

    def _uncount(self, writer: RankWriter) -> None:
        if writer in self._writes:  # not a writer replaced since (its count went with it)
            self._writes[writer] -= 1

    def count_written(self, num_bytes: int) -> None:
        """A write of ``num_bytes`` landed (a sender's, when it checked its writes)."""
        self._written_bytes += num_bytes

    def take_written_bytes(self) -> int:
        """The bytes of every write that landed since the last call."""
        num_bytes, self._written_bytes = self._written_bytes, 0
        return num_bytes

    def poll(self) -> None:
        """Each sender checks its writes when polled; here a dropped decode rank's agent goes
        once no write to it can land."""
        self._forget_left()

    def _forget_left(self) -> None:
        for agent_name, rank in list(self._leaving.items()):
            if self._writes[rank.writer] <= 0:
                del self._leaving[agent_name], self._writes[rank.writer]
                rank.writer.close()
                log.info("rank %d: forgot decode agent %s", self.place.rank, agent_name)

    def close(self) -> None:
        for rank in [*self._ranks.values(), *self._leaving.values()]:
            rank.writer.close()
        self._ranks.clear()
        self._leaving.clear()
        self.agent.deregister_memory(self._registration)


def _window_pool(msg: wire.Register) -> WindowPool | None:
    """The decode rank's hybrid SWA pool (a state pool of kind ``SWA_KIND``), if it has one:
    its pages of our sliding layers. ``ValueError`` when its addresses do not fit."""
    pools = [] if msg.state is UNSET else [p for p in msg.state if p.kind == SWA_KIND]
    if not pools:
        return None
    return WindowPool(pools[0].layer_ids, swa_pool_regions(pools[0].regions(msg.device)))
