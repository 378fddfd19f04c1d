"""How the native bootstrap protocol says things to a decode peer: a ``wire.Status`` on the
bootstrap socket (an abort's acknowledgement is ``status aborted``), and the aux row as one
WRITE between the prepared aux lists, with the NIXL notification ``wire.notif_tag(room)``
the decode SDK completes the room on. With a draft (``native.draft``), a decode that
registered a draft pool gets the aux row and the request's draft row in that one WRITE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from msgspec import UNSET

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.transfer import wire
from prefill_worker.transfer.native.bootstrap import BootstrapServer
from prefill_worker.transfer.nixl.poster import Write, WritePoster
from prefill_worker.transfer.pagemap import AUX_MEM_TYPE
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.refusals import ExpiringTable, summary

UNKNOWN_PEER = "decode peer not registered"


class NativeDialect:
    unreachable = "decode peer unreachable for status ok"

    def __init__(
        self,
        server: BootstrapServer,
        poster: WritePoster,
        local_aux: Any,  # our aux rows' prepared descriptor list
        refused: ExpiringTable[str, str],  # registrations refused lately, by agent name
        clock: Callable[[], float],
        draft: tuple[int, DraftRows] | None = None,  # our aux rows' address, our draft's rows
    ) -> None:
        self._server, self._poster, self._local_aux = server, poster, local_aux
        self._refused, self._clock = refused, clock
        self._draft = draft

    def send(self, peer: Peer, status: wire.Status, generation: int | None = None) -> bool:
        return self._server.send(peer.identity, status)

    def dropped(self, room: int, reason: str) -> wire.Status:
        """Not an outcome: the decode SDK registers and asks again."""
        return wire.Status(room, "failed", f"{UNKNOWN_PEER}: {reason}", "unknown_peer")

    def post_aux(self, peer: Peer, want: wire.Want, room: int, aux_row: int) -> Write:
        tag = wire.notif_tag(room)
        theirs = UNSET if peer.registration is None else peer.registration.draft
        if self._draft is not None and theirs is not UNSET:
            return self._post_with_draft(peer, want, tag, aux_row, theirs.rows_base_addr)
        local, remote = np.array([aux_row], np.int32), np.array([want.dst_aux_slot], np.int32)
        return self._poster.post(self._local_aux, local, peer.lists.aux, remote, tag, AUX_ROW_BYTES)

    def _post_with_draft(
        self, peer: Peer, want: wire.Want, tag: bytes, aux_row: int, rows_addr: int
    ) -> Write:
        """[aux row, draft row] -> the decode's [aux slot, draft row of that slot] (its rows
        are ours in size: the desk refused any other)."""
        assert self._draft is not None
        aux_base, rows = self._draft
        size, slot = rows.row_bytes, want.dst_aux_slot
        local = _descs([(aux_base + aux_row * AUX_ROW_BYTES, AUX_ROW_BYTES),
                        (rows.base_addr + aux_row * size, size)])  # fmt: skip
        remote = _descs([(peer.regions.aux_base_addr + slot * AUX_ROW_BYTES, AUX_ROW_BYTES),
                         (rows_addr + slot * size, size)])  # fmt: skip
        name = peer.agent_name

        def prepare(agent: Any) -> Any:
            local_descs = agent.get_xfer_descs(local, AUX_MEM_TYPE)
            remote_descs = agent.get_xfer_descs(remote, AUX_MEM_TYPE)
            return agent.initialize_xfer("WRITE", local_descs, remote_descs, name, tag)

        return self._poster.post_with(prepare, AUX_ROW_BYTES + size, 2)

    def why_no_handshake(self) -> str | None:
        return summary(self._refused, self._clock())


def _descs(runs: list[tuple[int, int]]) -> np.ndarray:
    """[n, 3] (addr, len, 0)."""
    return np.array([[addr, size, 0] for addr, size in runs], dtype=np.uint64)
