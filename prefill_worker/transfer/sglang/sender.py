"""One request's push into an SGLang decode: its KV writes, its aux write, and its state.

``SglangBackend`` owns the agent, the peers and the sockets; a sender gets what it needs in
an ``SglangContext`` and never calls back: replies for the decode and its own closing are
appended to the context's ``events`` and done by the backend, in order, on its next poll
(as ``nixl.sender`` does for native peers). Order of a successful push::

    send_pages × n   WRITE K,V of the chunk's pages into the pages the decode named
    send_aux         remembered; once no page write is in flight: the engine's aux row
                     is staged in SGLang's format (``sglang.aux``), then one WRITE of it
                     into row ``aux_index`` of each of the decode's metadata buffers
    aux landed       Reply(KV_STATUS success, confirm=sender) -> SUCCESS once queued

A failure is ``KV_STATUS failed`` with the reason; a decode's ABORT ends the room ABORTED
and is answered with ``ABORT_ACK`` once no write targets its pages. No NIXL notification is
sent: SGLang decodes complete a room on KV_STATUS (older ones also read notifications, but
only in their own tag format). Writes are posted through the backend's transfer thread
(``SglangContext.poster``) and tracked as ``nixl.sender``'s are (``nixl.writes``): released
when DONE, cancelled on failure or close, those not settled yet go to the backend in
``Closed.stuck``; every reply waits (``Reply.after``) until no byte of the room's writes can
land any more, since a decode told ``failed`` or ``ABORT_ACK`` reuses the pages at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefill_worker.kv.layout import KVLayout
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.context import Peer
from prefill_worker.transfer.nixl.poster import Write, WritePoster
from prefill_worker.transfer.nixl.writes import WriteSet
from prefill_worker.transfer.pagemap import AUX_MEM_TYPE, check_want, map_pages, region_indices
from prefill_worker.transfer.sglang import aux, frames


@dataclass(eq=False)
class SglangPeer:
    """A registered SGLang decode rank: the native peer record (its agent, pool and prepared
    list, as ``rooms.RoomBook`` keeps claims on it) and its metadata buffers."""

    peer: Peer  # identity: the agent name, encoded
    aux_ptrs: tuple[int, ...]
    endpoint: frames.Endpoint  # its control socket, as registered


@dataclass(frozen=True, slots=True)
class Reply:
    """Frames for the decode at ``endpoint``; with ``confirm``, that sender waits to hear
    whether they were queued (``confirm_ok``). They go out once every write in ``after`` is
    settled."""

    endpoint: frames.Endpoint
    frames: list[bytes]
    confirm: SglangSender | None = None
    after: tuple[Write, ...] = ()


@dataclass(frozen=True, slots=True)
class Closed:
    sender: SglangSender
    stuck: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class SglangContext:
    """What every sender of one backend shares; ``events`` is the backend's outbox."""

    poster: WritePoster  # where the agent lives (the backend's transfer thread)
    local_kv: Any  # our pool's prepared descriptor list, per layer (``pagemap.layer_view``)
    staging: aux.AuxStaging
    aux_rows: aux.AuxRowsView
    layout: KVLayout
    write_timeout_s: float
    clock: Callable[[], float]
    events: list[Reply | Closed] = field(default_factory=list)


class SglangSender:
    """KVSender into an SGLang decode; progress happens in ``progress()`` (the backend)."""

    def __init__(
        self,
        ctx: SglangContext,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
    ) -> None:
        self._ctx = ctx
        self.room, self.request_id = room, request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.allowed_peer = allowed_peer
        self.peer: SglangPeer | None = None
        self.is_closed = False
        self._state = KVPoll.BOOTSTRAPPING
        self._reason: str | None = None
        self._want: wire.Want | None = None
        self._writes = WriteSet(ctx.write_timeout_s)
        self._aux_row: int | None = None
        self._is_aux_posted = self._is_ok_told = False
        self._ack: tuple[frames.Endpoint, int | None] | None = None  # ABORT_ACK due

    # -- KVSender -----------------------------------------------------------------------

    def poll(self) -> KVPoll:
        return self._state

    def num_cached_tokens(self) -> int:
        return 0 if self._want is None else self._want.num_cached_tokens

    def written_bytes(self) -> int:
        return self._writes.written_bytes

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        if self._state.is_terminal:
            return
        assert self._want is not None and self.peer is not None, "send_pages before READY"
        self._state = KVPoll.TRANSFERRING
        layout, want = self._ctx.layout, self._want
        try:
            src, dst = map_pages(
                page_ids, first_page, want.num_cached_tokens // layout.page_size, want.dst_page_ids
            )
        except ValueError as exc:
            return self.fail(str(exc))
        if len(src):
            n = 2 * layout.num_layers
            local = region_indices(src, n, layout.num_pages)
            remote = region_indices(dst, n, self.peer.peer.regions.layout.num_pages)
            self._post_kv(local, remote, len(local) * layout.page_bytes)

    def send_aux(self, aux_row: int) -> None:
        if not self._state.is_terminal:
            assert self._want is not None, "send_aux before READY"
            self._state, self._aux_row = KVPoll.TRANSFERRING, aux_row

    def fail(self, reason: str) -> None:
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.FAILED, reason
            self._tell(frames.kv_status(self.room, False, reason))

    def failure_reason(self) -> str | None:
        return self._reason

    def why_no_handshake(self) -> str | None:
        return None  # a refused SGLang decode still sends its request: the room fails at once

    def close(self) -> None:
        if self.is_closed:
            return
        self.fail("the request ended before its transfer")
        self._writes.release_all()
        self._maybe_ack()
        self.is_closed = True
        self._ctx.events.append(Closed(self, self._writes.unsettled()))

    # -- driven by the backend ----------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self._writes)

    @property
    def needs_progress(self) -> bool:
        is_aux_due = self._state is KVPoll.TRANSFERRING and self._aux_row is not None
        return bool(self._writes) or (is_aux_due and not self._is_ok_told) or bool(self._ack)

    def accepts(self, agent_name: str) -> bool:
        return self.allowed_peer is None or self.allowed_peer == agent_name

    def bind(self, peer: SglangPeer, want: wire.Want) -> None:
        """The decode's transfer request for this room (``sglang.desk`` checked what it asks
        beyond pages): READY, or FAILED with the reason. Replies go to the peer's endpoint."""
        self.peer = peer
        if self._state.is_terminal:  # failed before the request came: tell the decode now
            self._tell(frames.kv_status(self.room, False, self._reason))
            return
        layout, regions = self._ctx.layout, peer.peer.regions
        reason = check_want(want, self.num_prompt_tokens, layout, regions)
        if reason is not None:
            return self.fail(reason)
        self._want = want
        if self._state is KVPoll.BOOTSTRAPPING:
            self._state = KVPoll.READY

    def abort_by_peer(self, ack_to: frames.Endpoint | None, generation: int | None) -> None:
        """The decode aborted the room: ABORTED; ``ack_to`` gets ABORT_ACK once no write
        targets its pages (None: it was answered when its ABORT came, before this request)."""
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.ABORTED, "aborted by decode"
        if ack_to is not None:
            self._ack = (ack_to, generation)
            self._maybe_ack()

    def lose_peer(self, reason: str) -> None:
        """The decode is forgotten (evicted, or the worker is closing): every write ends."""
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.PEER_LOST, reason
            self._tell(frames.kv_status(self.room, False, reason))
        self._writes.release_all()
        self._ack = None
        self.peer = None

    def progress(self) -> None:
        why = self._writes.check(self._ctx.clock())
        if why is not None:
            self.fail(why)
        is_aux_due = self._state is KVPoll.TRANSFERRING and self._aux_row is not None
        if is_aux_due and not self._writes and not self._is_ok_told:
            if not self._is_aux_posted:
                self._post_aux()
            else:
                self._is_ok_told = True
                self._tell(frames.kv_status(self.room, True, None), confirm=True)
        self._maybe_ack()

    def confirm_ok(self, is_delivered: bool) -> None:
        if self._state is KVPoll.TRANSFERRING:
            if is_delivered:
                self._state = KVPoll.SUCCESS
            else:
                self.fail("decode control socket unreachable for KV_STATUS")

    # -- internals ----------------------------------------------------------------------

    def _tell(self, message: list[bytes], confirm: bool = False) -> None:
        if self.peer is not None:  # no request frame yet: a later one learns the reason
            confirming = self if confirm else None
            reply = Reply(self.peer.endpoint, message, confirming, self._writes.pending())
            self._ctx.events.append(reply)

    def _post_kv(self, local: Any, remote: Any, num_bytes: int) -> None:
        assert self.peer is not None
        ctx, remote_list = self._ctx, self.peer.peer.lists.kv
        write = ctx.poster.post(ctx.local_kv, local, remote_list, remote, b"", num_bytes)
        self._writes.add(write, self._ctx.clock())

    def _post_aux(self) -> None:
        """Stage the row in SGLang's format (here: the engine owns the aux rows), then one
        WRITE of it into ``aux_index`` of each metadata buffer, built where the agent lives."""
        assert self.peer is not None and self._want is not None and self._aux_row is not None
        self._is_aux_posted = True
        staging, row = self._ctx.staging, self._aux_row
        staging.fill(row, self._ctx.aux_rows.read(row), self.room)
        local = staging.local_descs(row)
        remote = aux.remote_descs(self.peer.aux_ptrs, self._want.dst_aux_slot)
        name = self.peer.peer.agent_name

        def prepare(agent: Any) -> Any:
            local_descs = agent.get_xfer_descs(local, AUX_MEM_TYPE)
            remote_descs = agent.get_xfer_descs(remote, AUX_MEM_TYPE)
            return agent.initialize_xfer("WRITE", local_descs, remote_descs, name)

        write = self._ctx.poster.post_with(prepare, aux.ROW_DTYPE.itemsize)
        self._writes.add(write, self._ctx.clock())

    def _maybe_ack(self) -> None:
        if self._ack is not None and not self._writes:
            endpoint, generation = self._ack
            self._ack = None
            message = frames.abort_ack(self.room, generation)
            self._ctx.events.append(Reply(endpoint, message, None, self._writes.pending()))
