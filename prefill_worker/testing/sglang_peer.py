"""The reference decode peer's SGLang mode: its KV comes over SGLang's PD protocol, received
by SGLang's own decode-side transfer code. A test and demo tool, NOT a decode server.

Imported only in a process where a pinned SGLang is importable (``sglang_env``); run as
``python -m prefill_worker.testing.decode_peer --sglang --http HOST:PORT ...``.

One SGLang decode rank per peer, built by part 1's harness (``sglang_child.Decode``): SGLang's
``NixlKVManager`` in decode mode over the real ``MHATokenToKVPool`` and ``MetadataBuffers``
on the CPU, with the geometry of the peer's own KV pool. Per room (``SglangSource.want``),
exactly as an SGLang decode server does: once SGLang knows the prefill the router named (its
``bootstrap_host:port``; asked once a second, 15 tries, as SGLang's decode scheduler does), a
``NixlKVReceiver`` for it, ``init``, ``send_metadata(pages, aux_index)``, then ``poll``
until SGLang says Success or Failed. On Success the prompt's pages are copied from SGLang's
pool into the peer's (same page ids; the two layouts are byte-identical per page) and the
first token is read from SGLang's metadata row; the peer then decodes with our model code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

from prefill_worker.kv.aux import AuxRow
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.testing.sglang_child import Decode, publish
from prefill_worker.transfer.decode.rooms import RoomState, RoomStatus

_PENDING = RoomStatus(RoomState.PENDING)
# SGLang's decode scheduler asks for a prefill's info once a second, 15 times, before it fails
# the requests waiting for it (``disaggregation/decode.py``, 0.5.20-0.5.23).
_INFO_RETRY_S, _INFO_TRIES = 1.0, 15


@dataclass(slots=True)
class _Room:
    page_ids: list[int]  # the prompt's pages
    receiver: Any  # NixlKVReceiver; None until the prefill's info is known (or on failure)
    status: RoomStatus
    aux_slot: int = 0
    num_cached_tokens: int = 0
    num_info_tries: int = 0
    next_try_at: float = 0.0


class SglangRank:
    """One SGLang decode rank beside the peer's pool; ``connect(addr)`` per prefill worker."""

    def __init__(self, kv_cache: KVCache, model_path: str, num_aux_rows: int) -> None:
        layout = kv_cache.layout
        spec = {
            "bootstrap": "",  # each room names its prefill
            "page_size": layout.page_size,
            "dtype": layout.dtype,
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "num_pages": layout.num_pages,
            "num_aux_rows": num_aux_rows,
        }
        self.kv_cache = kv_cache
        self.decode = Decode(spec, publish(model_path))

    def connect(self, bootstrap_addr: str) -> SglangSource:
        return SglangSource(self, bootstrap_addr)

    def land(self, page_ids: list[int]) -> None:
        """Copy the pages SGLang received into the peer's pool."""
        index = torch.tensor(page_ids, dtype=torch.long)
        pool, cache = self.decode.pool, self.kv_cache
        for ours, theirs in ((cache.k, pool.k_buffer), (cache.v, pool.v_buffer)):
            for layer, dst in enumerate(ours):
                dst[index] = theirs[layer].view(dst.shape)[index]


class SglangSource:
    """``decode_peer.KVSource`` for one prefill worker, through SGLang's receiver. The
    prefill's server info is SGLang's to cache (``try_ensure_parallel_info``, asked per room
    as SGLang's decode scheduler does): its heartbeat drops it when the prefill goes away or
    restarts, and the next room fetches it again and registers afresh."""

    def __init__(self, rank: SglangRank, bootstrap_addr: str) -> None:
        self._rank, self.bootstrap_addr = rank, bootstrap_addr
        self._rooms: dict[int, _Room] = {}
        self._info()  # the prefill's /route, now if it answers (else on the first room)

    def want(
        self, room: int, page_ids: list[int] | Any, aux_slot: int, num_cached_tokens: int
    ) -> None:
        pages = [int(p) for p in page_ids]
        entry = _Room(pages, None, _PENDING, aux_slot, num_cached_tokens)
        self._rooms[room] = entry
        self._try_start(room, entry)

    def progress(self) -> None:
        """Rooms still waiting for the prefill's info ask again (the transfers themselves run
        on SGLang's manager's threads)."""
        now = time.monotonic()
        for room, entry in self._rooms.items():
            if entry.receiver is None and entry.status is _PENDING and now >= entry.next_try_at:
                self._try_start(room, entry)

    def _try_start(self, room: int, entry: _Room) -> None:
        entry.num_info_tries += 1
        entry.next_try_at = time.monotonic() + _INFO_RETRY_S
        if not self._info():
            if entry.num_info_tries >= _INFO_TRIES:
                why = f"no prefill server info from {self.bootstrap_addr} after {_INFO_TRIES} tries"
                entry.status = RoomStatus(RoomState.FAILED, why)
            return
        try:
            receiver = NixlKVReceiver(self._rank.decode.manager, self.bootstrap_addr, room)
            receiver.init(0)
            skip = entry.num_cached_tokens // self._rank.decode.page_size
            pages = np.asarray(entry.page_ids[skip:], dtype=np.int32)
            receiver.send_metadata(pages, entry.aux_slot, None, entry.num_cached_tokens)
        except Exception as exc:  # one room's failure ends that room only
            entry.status = RoomStatus(RoomState.FAILED, repr(exc))
            return
        entry.receiver = receiver

    def poll(self, room: int) -> RoomStatus:
        entry = self._rooms[room]
        if entry.status.state is RoomState.PENDING and entry.receiver is not None:
            state = entry.receiver.poll()
            if state == KVPoll.Success:
                self._rank.land(entry.page_ids)
                entry.status = RoomStatus(RoomState.DONE)
            elif state == KVPoll.Failed:
                manager = self._rank.decode.manager
                with manager.failure_lock:
                    reason = manager.failure_records.get(room)
                entry.status = RoomStatus(RoomState.FAILED, str(reason))
        return entry.status

    def read_aux(self, aux_slot: int) -> AuxRow:
        row = self._rank.decode.meta.get_buf(aux_slot)
        return AuxRow(
            first_token_id=int(row[0][0]),
            first_token_logprob=float(row[2][0]),
            num_prompt_tokens=0,  # SGLang's row does not carry it
            num_cached_tokens=int(row[1][0]),
        )

    def forget(self, room: int) -> None:
        self._rooms.pop(room, None)

    def close(self) -> None:
        return None  # the manager's threads end with the process

    def _info(self) -> bool:
        manager = self._rank.decode.manager
        try:  # at once when SGLang holds it
            return bool(manager.try_ensure_parallel_info(self.bootstrap_addr))
        except Exception:  # not up yet, or not a prefill: the room that needs it fails
            return False
