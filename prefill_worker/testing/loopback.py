"""An in-process transfer backend for tests only: the "decode peer" is the test itself.

Outside the production import graph: no config value selects it.

The test plays the decode side through ``want``, ``abort`` and ``told`` (what the decode
peer was told). Pages are mapped with the same ``pagemap`` rules as NIXL; when the backend
is given a decode pool (``dst_regions``), bytes are really copied with ``memmove``, else
only the page mapping is recorded in ``sent``. Everything completes on the next ``poll()``.
"""

from __future__ import annotations

import ctypes
import select
from collections.abc import Sequence

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll, KVSender
from prefill_worker.transfer.pagemap import check_want, map_pages


class LoopbackSender:
    """A KVSender whose writes land at once; success is reported on the next poll."""

    def __init__(self, backend: LoopbackBackend, room: int, num_prompt_tokens: int) -> None:
        self._backend = backend
        self.room = room
        self.num_prompt_tokens = num_prompt_tokens
        self.state = KVPoll.BOOTSTRAPPING
        self.reason: str | None = None
        self.want: wire.Want | None = None
        self.is_aux_sent = False
        self.is_closed = False
        self.num_written_bytes = 0

    def poll(self) -> KVPoll:
        return self.state

    def num_cached_tokens(self) -> int:
        return 0 if self.want is None else self.want.num_cached_tokens

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        if self.state.is_terminal:
            return
        assert self.want is not None, "send_pages before READY"
        self.state = KVPoll.TRANSFERRING
        num_cached_pages = self.want.num_cached_tokens // self._backend.regions.layout.page_size
        try:
            src, dst = map_pages(page_ids, first_page, num_cached_pages, self.want.dst_page_ids)
        except ValueError as exc:
            return self.fail(str(exc))
        self._backend.copy_pages(self.room, [int(p) for p in src], [int(p) for p in dst])
        layout = self._backend.regions.layout
        self.num_written_bytes += len(src) * 2 * layout.num_layers * layout.page_bytes

    def send_aux(self, aux_row: int) -> None:
        if not self.state.is_terminal:
            assert self.want is not None, "send_aux before READY"
            self.state = KVPoll.TRANSFERRING
            self._backend.copy_aux(aux_row, self.want.dst_aux_slot)
            self.is_aux_sent = True
            self.num_written_bytes += AUX_ROW_BYTES

    def fail(self, reason: str) -> None:
        if not self.state.is_terminal:
            self.state, self.reason = KVPoll.FAILED, reason
            self._backend.tell(self.room, "failed", reason)

    def failure_reason(self) -> str | None:
        return self.reason

    def written_bytes(self) -> int:
        return self.num_written_bytes

    def close(self) -> None:
        self.fail("the request ended before its transfer")
        self.is_closed = True
        self._backend.forget(self)


class LoopbackBackend:
    """TransferBackend for unit tests; see the module docstring."""

    bootstrap_endpoint = "loopback"

    def __init__(self, regions: KVRegions, dst_regions: KVRegions | None = None) -> None:
        self.regions = regions
        self.dst_regions = dst_regions
        self.senders: dict[int, LoopbackSender] = {}  # open senders by room
        self.wants: dict[int, wire.Want] = {}  # wants not yet matched
        self.told: dict[int, tuple[wire.StatusCode, str | None]] = {}  # room -> last status
        self.sent: dict[int, list[tuple[int, int]]] = {}  # room -> (local page, decode page)

    # -- the decode side, played by the test --------------------------------------------

    def want(
        self, room: int, dst_page_ids: Sequence[int], dst_aux_slot: int, num_cached_tokens: int
    ) -> None:
        want = wire.Want.of(room, dst_page_ids, dst_aux_slot, num_cached_tokens)
        sender = self.senders.get(room)
        if sender is None:
            self.wants[room] = want
        else:
            self._bind(sender, want)

    def abort(self, room: int) -> None:
        self.wants.pop(room, None)
        sender = self.senders.get(room)
        if sender is not None and not sender.state.is_terminal:
            sender.state, sender.reason = KVPoll.ABORTED, "aborted by decode"
        self.tell(room, "aborted", "aborted by decode")

    # -- TransferBackend ----------------------------------------------------------------

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender:
        # One in-process decode side: there is no other peer to keep out.
        sender = LoopbackSender(self, room, num_prompt_tokens)
        if room in self.senders:
            sender.fail(f"bootstrap_room {room} is already in use")
            return sender
        self.senders[room] = sender
        if room in self.wants:
            self._bind(sender, self.wants.pop(room))
        return sender

    def poll(self) -> None:
        for sender in list(self.senders.values()):
            if sender.state is KVPoll.TRANSFERRING and sender.is_aux_sent:
                sender.state = KVPoll.SUCCESS
                self.tell(sender.room, "ok", None)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Nothing arrives on its own here: sleep on ``wake_fd``, briefly if a poll is due."""
        if any(s.state is KVPoll.TRANSFERRING and s.is_aux_sent for s in self.senders.values()):
            return
        select.select([] if wake_fd is None else [wake_fd], [], [], max(timeout_s, 0.0))

    def close(self) -> None:
        for sender in list(self.senders.values()):
            sender.close()

    # -- used by LoopbackSender ---------------------------------------------------------

    def tell(self, room: int, code: wire.StatusCode, reason: str | None) -> None:
        self.told[room] = (code, reason)

    def forget(self, sender: LoopbackSender) -> None:
        if self.senders.get(sender.room) is sender:
            del self.senders[sender.room]

    def copy_pages(self, room: int, src: list[int], dst: list[int]) -> None:
        self.sent.setdefault(room, []).extend(zip(src, dst, strict=True))
        if self.dst_regions is None:
            return
        page_bytes = self.regions.layout.page_bytes
        pairs = zip(
            self.regions.k_base_addrs + self.regions.v_base_addrs,
            self.dst_regions.k_base_addrs + self.dst_regions.v_base_addrs,
            strict=True,
        )
        for src_base, dst_base in pairs:
            for s, d in zip(src, dst, strict=True):
                ctypes.memmove(dst_base + d * page_bytes, src_base + s * page_bytes, page_bytes)

    def copy_aux(self, aux_row: int, dst_slot: int) -> None:
        if self.dst_regions is not None:
            dst = self.dst_regions.aux_base_addr + dst_slot * AUX_ROW_BYTES
            src = self.regions.aux_base_addr + aux_row * AUX_ROW_BYTES
            ctypes.memmove(dst, src, AUX_ROW_BYTES)

    def _bind(self, sender: LoopbackSender, want: wire.Want) -> None:
        remote = self.dst_regions or self.regions
        reason = check_want(want, sender.num_prompt_tokens, self.regions.layout, remote)
        if reason is not None:
            return sender.fail(reason)
        sender.want = want
        if sender.state is KVPoll.BOOTSTRAPPING:
            sender.state = KVPoll.READY
