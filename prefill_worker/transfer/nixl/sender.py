"""One request's push over NIXL: its writes in flight, its deadlines, and its state.

``NixlBackend`` owns the agent, the descriptor lists and the peers; a sender gets the shared
ones in a ``SendContext`` (``nixl.context``) and never calls back: what the backend must do
(a status for the peer, forgetting a closed sender, reaping writes not yet released) is
appended to the context's ``events`` and done by the backend when it drains them, in order,
on its next ``poll()``. Writes go through the context's poster (``nixl.poster``: on the
transfer thread, so ``send_pages`` never copies); the sender reads their states when the
backend calls ``progress()``. Order of a successful push::

    send_pages × n   WRITE K,V of the chunk's pages       (in flight, each with a deadline)
    send_aux         remembered; once no page write is in flight:
                     WRITE the aux row, notification notif_tag(room)
    aux landed       Tell(`status ok`, confirm=sender); the backend sends it and calls
                     ``confirm_ok(delivered)``  ->  SUCCESS (or FAILED when unreachable)

Writes are released when DONE; on failure or close they are released even if in flight
(NIXL cancels). ``close()`` never waits: a write not yet settled (its release is under way on
the transfer thread, or NIXL refused it) goes to the backend in ``Closed.stuck``, which
retries on later polls and, past a deadline, disconnects the peer (that ends its writes). A
status for the peer waits for the writes in flight or unsettled (``Tell.after``): once the
decode hears ``failed`` or ``aborted`` it may reuse the pages. ``written_bytes`` counts what
landed: the descriptors of each DONE write (pages × regions × region page bytes, and the aux
row).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.context import Closed, Peer, SendContext, Tell
from prefill_worker.transfer.nixl.writes import WriteSet
from prefill_worker.transfer.pagemap import check_want, map_pages, region_indices
from prefill_worker.transfer.wire import notif_tag

STUCK_RELEASE_S = 0.5  # a handle NIXL refuses to release is retried this long, then its peer goes


class NixlSender:
    """KVSender over NIXL; all progress happens in ``progress()``, called by the backend."""

    def __init__(
        self,
        ctx: SendContext,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
    ) -> None:
        self._ctx = ctx
        self.room = room
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.allowed_peer = allowed_peer  # the only decode agent that may claim the room
        self.peer: Peer | None = None
        self.is_closed = False
        self._state = KVPoll.BOOTSTRAPPING
        self._reason: str | None = None
        self._want: wire.Want | None = None
        self._writes = WriteSet(ctx.peer_timeout_s)
        self._aux_row: int | None = None
        self._is_aux_posted = False
        self._is_ok_told = False  # `status ok` handed to the backend, waiting for confirm_ok
        self._is_ack_due = False  # the peer aborted; acknowledge once no write is in flight
        self._index_s = 0.0  # building descriptor indices (engine thread)
        self._index_cpu_s = 0.0

    # -- KVSender -----------------------------------------------------------------------

    def poll(self) -> KVPoll:
        return self._state

    def num_cached_tokens(self) -> int:
        return 0 if self._want is None else self._want.num_cached_tokens

    def written_bytes(self) -> int:
        return self._writes.written_bytes

    @property
    def prep_s(self) -> float:
        """Building descriptor indices and transfer requests (the finished ones)."""
        return self._index_s + self._writes.prep_s

    @property
    def prep_cpu_s(self) -> float:
        """The same in CPU time of the threads that did it."""
        return self._index_cpu_s + self._writes.prep_cpu_s

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        if self._state.is_terminal:
            return
        assert self._want is not None and self.peer is not None, "send_pages before READY"
        self._state = KVPoll.TRANSFERRING
        layout = self._ctx.layout
        num_cached_pages = self._want.num_cached_tokens // layout.page_size
        try:
            src, dst = map_pages(page_ids, first_page, num_cached_pages, self._want.dst_page_ids)
        except ValueError as exc:
            return self.fail(str(exc))
        if len(src):
            start, start_cpu = time.perf_counter(), time.thread_time()
            num_regions = layout.num_regions  # 2L layer-major, 1 page-major
            local = region_indices(src, num_regions, layout.num_pages)
            remote = region_indices(dst, num_regions, self.peer.regions.layout.num_pages)
            self._index_s += time.perf_counter() - start
            self._index_cpu_s += time.thread_time() - start_cpu
            self._post(local, remote, b"", len(local) * layout.region_page_bytes)

    def send_aux(self, aux_row: int) -> None:
        if not self._state.is_terminal:
            assert self._want is not None, "send_aux before READY"
            self._state = KVPoll.TRANSFERRING
            self._aux_row = aux_row

    def fail(self, reason: str) -> None:
        if self._state.is_terminal:
            return
        self._state, self._reason = KVPoll.FAILED, reason
        self._tell("failed", reason)

    def failure_reason(self) -> str | None:
        return self._reason

    def why_no_handshake(self) -> str | None:
        return self._ctx.refused.summary(self._ctx.clock())

    def close(self) -> None:
        """Never waits: writes in flight are cancelled (released); those not settled yet go
        to the backend with the ``Closed`` event."""
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
        """True while ``progress()`` has something to watch: writes in flight, an aux row
        to post, an acknowledgement due. NIXL gives no fd to wait on, so this means polling."""
        is_aux_due = self._state is KVPoll.TRANSFERRING and self._aux_row is not None
        return bool(self._writes) or (is_aux_due and not self._is_ok_told) or self._is_ack_due

    def accepts(self, agent_name: str) -> bool:
        """May this decode agent claim the room (the router may have named one)?"""
        return self.allowed_peer is None or self.allowed_peer == agent_name

    def bind(self, peer: Peer, want: wire.Want) -> None:
        """The decode peer's `want` for this room arrived: READY, or FAILED with the reason."""
        self.peer = peer
        if self._state.is_terminal:  # failed before the want came: tell the peer now
            self._tell("failed", self._reason)
            return
        layout = self._ctx.layout
        reason = check_want(want, self.num_prompt_tokens, layout, peer.regions)
        if reason is not None:
            return self.fail(reason)
        self._want = want
        if self._state is KVPoll.BOOTSTRAPPING:
            self._state = KVPoll.READY

    def abort_by_peer(self) -> None:
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.ABORTED, "aborted by decode"
        self._is_ack_due = True
        self._maybe_ack()

    def lose_peer(self, reason: str) -> None:
        """The peer is gone (silent, left, or disconnected): PEER_LOST, every write cancelled.
        The peer is told too, in case it can still hear (it left, or registered again)."""
        if not self._state.is_terminal:
            self._state, self._reason = KVPoll.PEER_LOST, reason
            self._tell("failed", reason)
        self._is_ack_due = False
        self._writes.release_all()  # its peer is being dropped: nothing else would end them
        self.peer = None

    def progress(self) -> None:
        why = self._writes.check(self._ctx.clock())
        if why is not None:
            self.fail(why)
        is_aux_due = self._state is KVPoll.TRANSFERRING and self._aux_row is not None
        if is_aux_due and not self._writes and not self._is_ok_told:
            assert self._aux_row is not None
            if not self._is_aux_posted:
                self._post_aux(self._aux_row)
            else:
                self._is_ok_told = True
                self._tell("ok", None, confirm=True)
        self._maybe_ack()

    def confirm_ok(self, is_delivered: bool) -> None:
        """The backend's answer to the `status ok` Tell: SUCCESS, or FAILED if unreachable."""
        if self._state is not KVPoll.TRANSFERRING:
            return
        if is_delivered:
            self._state = KVPoll.SUCCESS
        else:
            self.fail("decode peer unreachable for status ok")

    # -- internals ----------------------------------------------------------------------

    def _tell(self, code: wire.StatusCode, reason: str | None, confirm: bool = False) -> None:
        if self.peer is None:
            return  # no peer yet: a `want` that comes later learns the reason (bind)
        status = wire.Status(self.room, code, reason)
        tell = Tell(self.peer.identity, status, self if confirm else None, self._writes.pending())
        self._ctx.events.append(tell)

    def _post_aux(self, aux_row: int) -> None:
        assert self._want is not None and self.peer is not None
        self._is_aux_posted = True
        local_idx = np.array([aux_row], np.int32)
        remote_idx = np.array([self._want.dst_aux_slot], np.int32)
        self._post(local_idx, remote_idx, notif_tag(self.room), AUX_ROW_BYTES, is_aux=True)

    def _post(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes,
        num_bytes: int,
        is_aux: bool = False,
    ) -> None:
        """Queue the write (the poster prepares and posts it); its state comes later."""
        assert self.peer is not None
        ours, theirs = self._ctx.local_lists, self.peer.lists
        local_list, remote_list = (ours.aux, theirs.aux) if is_aux else (ours.kv, theirs.kv)
        write = self._ctx.poster.post(local_list, local, remote_list, remote, notif, num_bytes)
        self._writes.add(write, self._ctx.clock())

    def _maybe_ack(self) -> None:
        if self._is_ack_due and not self._writes:
            self._is_ack_due = False
            self._tell("aborted", "aborted by decode")
