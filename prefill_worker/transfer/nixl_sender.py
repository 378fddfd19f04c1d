"""One request's push over NIXL: its writes in flight, its deadlines, and its state.

``NixlBackend`` owns the agent, the descriptor lists and the peers; a sender asks its host
(a narrow Protocol) for them. Order of a successful push::

    send_pages × n   WRITE K,V of the chunk's pages       (in flight, each with a deadline)
    send_aux         remembered; once no page write is in flight:
                     WRITE the aux row, notification notif_tag(room)
    aux landed       `status ok` to the peer  ->  SUCCESS

Handles are released when their write is DONE; on failure or close they are released even if
in flight (NIXL cancels), and if that is refused the peer is disconnected, which ends them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.agent import NIXL_ERRORS, PreppedLists
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.pagemap import check_want, map_pages, region_indices

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 0.5  # close() waits this long for writes in flight before cancelling them


def notif_tag(room: int) -> bytes:
    """The NIXL notification that marks a room's aux row as landed on the decode side."""
    return b"pw1:room:%d" % room


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


class SenderHost(Protocol):
    agent: Any
    local_lists: PreppedLists
    regions: KVRegions
    peer_timeout_s: float
    clock: Callable[[], float]

    def send_status(
        self, sender: NixlSender, code: wire.StatusCode, reason: str | None
    ) -> bool: ...

    def forget(self, sender: NixlSender) -> None: ...

    def drop_peer_of(self, sender: NixlSender, reason: str) -> None: ...


@dataclass(slots=True)
class _Write:
    handle: Any  # nixl_xfer_handle
    deadline: float


class NixlSender:
    """KVSender over NIXL; all progress happens in ``progress()``, called by the backend."""

    def __init__(
        self,
        host: SenderHost,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
    ) -> None:
        self._host = host
        self.room = room
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.allowed_peer = allowed_peer  # the only decode agent that may claim the room
        self.peer: Peer | None = None
        self.is_closed = False
        self._state = KVPoll.BOOTSTRAPPING
        self._reason: str | None = None
        self._want: wire.Want | None = None
        self._writes: list[_Write] = []
        self._aux_row: int | None = None
        self._is_aux_posted = False
        self._is_ack_due = False  # the peer aborted; acknowledge once no write is in flight
        self.prep_s = 0.0  # time spent building descriptor indices and transfer requests

    # -- KVSender -----------------------------------------------------------------------

    def poll(self) -> KVPoll:
        return self._state

    def num_cached_tokens(self) -> int:
        return 0 if self._want is None else self._want.num_cached_tokens

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        if self._state.is_terminal:
            return
        assert self._want is not None and self.peer is not None, "send_pages before READY"
        self._state = KVPoll.TRANSFERRING
        num_cached_pages = self._want.num_cached_tokens // self._host.regions.layout.page_size
        try:
            src, dst = map_pages(page_ids, first_page, num_cached_pages, self._want.dst_page_ids)
        except ValueError as exc:
            return self.fail(str(exc))
        if len(src):
            start = time.perf_counter()
            num_regions = 2 * self._host.regions.layout.num_layers
            local = region_indices(src, num_regions, self._host.regions.layout.num_pages)
            remote = region_indices(dst, num_regions, self.peer.regions.layout.num_pages)
            self._post(local, remote, b"", start)

    def send_aux(self, aux_row: int) -> None:
        if not self._state.is_terminal:
            assert self._want is not None, "send_aux before READY"
            self._state = KVPoll.TRANSFERRING
            self._aux_row = aux_row

    def fail(self, reason: str) -> None:
        if self._state.is_terminal:
            return
        self._state, self._reason = KVPoll.FAILED, reason
        self._host.send_status(self, "failed", reason)

    def failure_reason(self) -> str | None:
        return self._reason

    def close(self) -> None:
        if self.is_closed:
            return
        self.fail("the request ended before its transfer")
        deadline = self._host.clock() + min(CLOSE_WAIT_S, self._host.peer_timeout_s)
        while self._writes and self._host.clock() < deadline:
            self._check_writes(is_closing=True)
        self._release_all()
        self._maybe_ack()
        self.is_closed = True
        self._host.forget(self)

    # -- driven by the backend ----------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self._writes)

    def accepts(self, agent_name: str) -> bool:
        """May this decode agent claim the room (the router may have named one)?"""
        return self.allowed_peer is None or self.allowed_peer == agent_name

    def bind(self, peer: Peer, want: wire.Want) -> None:
        """The decode peer's `want` for this room arrived: READY, or FAILED with the reason."""
        self.peer = peer
        if self._state.is_terminal:  # failed before the want came: tell the peer now
            self._host.send_status(self, "failed", self._reason)
            return
        reason = check_want(want, self.num_prompt_tokens, self._host.regions.layout, peer.regions)
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
            self._host.send_status(self, "failed", reason)
        self._is_ack_due = False
        self._release_all()
        self.peer = None

    def progress(self) -> None:
        self._check_writes(is_closing=False)
        if self._state is KVPoll.TRANSFERRING and not self._writes and self._aux_row is not None:
            if not self._is_aux_posted:
                self._post_aux(self._aux_row)
            elif self._host.send_status(self, "ok", None):
                self._state = KVPoll.SUCCESS
            else:
                self.fail("decode peer unreachable for status ok")
        self._maybe_ack()

    # -- internals ----------------------------------------------------------------------

    def _post_aux(self, aux_row: int) -> None:
        assert self._want is not None and self.peer is not None
        self._is_aux_posted = True
        local_idx = np.array([aux_row], np.int32)
        remote_idx = np.array([self._want.dst_aux_slot], np.int32)
        self._post(local_idx, remote_idx, notif_tag(self.room), time.perf_counter(), is_aux=True)

    def _post(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes,
        start: float,
        is_aux: bool = False,
    ) -> None:
        assert self.peer is not None
        agent = self._host.agent
        ours, theirs = self._host.local_lists, self.peer.lists
        local_list, remote_list = (ours.aux, theirs.aux) if is_aux else (ours.kv, theirs.kv)
        try:
            handle = agent.make_prepped_xfer("WRITE", local_list, local, remote_list, remote, notif)
        except NIXL_ERRORS as exc:
            return self.fail(f"NIXL could not prepare the write: {exc}")
        finally:
            self.prep_s += time.perf_counter() - start
        self._writes.append(_Write(handle, self._host.clock() + self._host.peer_timeout_s))
        try:
            state = agent.transfer(handle)
        except NIXL_ERRORS as exc:
            state = f"ERR ({exc})"
        if state.startswith("ERR"):
            self.fail(f"NIXL write failed to start: {state}")

    def _check_writes(self, is_closing: bool) -> None:
        now = self._host.clock()
        for write in list(self._writes):
            try:
                state = self._host.agent.check_xfer_state(write.handle)
            except NIXL_ERRORS as exc:
                state = f"ERR ({exc})"
            if state == "DONE":
                self._writes.remove(write)
                write.handle.release()
            elif state != "PROC":
                self._writes.remove(write)
                self._release(write)
                self.fail(f"NIXL write failed: {state}")
            elif now >= write.deadline and not is_closing:
                self.fail(f"write still in flight after {self._host.peer_timeout_s:g} s")

    def _release(self, write: _Write) -> bool:
        try:
            write.handle.release()
        except NIXL_ERRORS as exc:
            log.warning("request %s: releasing a write in flight: %s", self.request_id, exc)
            return False
        return True

    def _release_all(self) -> None:
        stuck = [w for w in self._writes if not self._release(w)]
        if stuck:
            self._host.drop_peer_of(self, "writes could not be cancelled")
            for write in stuck:
                if not self._release(write):
                    log.error("request %s: a write handle is leaked to NIXL", self.request_id)
        self._writes.clear()

    def _maybe_ack(self) -> None:
        if self._is_ack_due and not self._writes:
            self._is_ack_due = False
            self._host.send_status(self, "aborted", "aborted by decode")
