"""How the native bootstrap protocol says things to a decode peer: a ``wire.Status`` on the
bootstrap socket (an abort's acknowledgement is ``status aborted``), and the aux row as one
WRITE between the prepared aux lists, with the NIXL notification ``wire.notif_tag(room)``
the decode SDK completes the room on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.transfer import wire
from prefill_worker.transfer.native.bootstrap import BootstrapServer
from prefill_worker.transfer.nixl.poster import Write, WritePoster
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
    ) -> None:
        self._server, self._poster, self._local_aux = server, poster, local_aux
        self._refused, self._clock = refused, clock

    def send(self, peer: Peer, status: wire.Status, generation: int | None = None) -> bool:
        return self._server.send(peer.identity, status)

    def dropped(self, room: int, reason: str) -> wire.Status:
        """Not an outcome: the decode SDK registers and asks again."""
        return wire.Status(room, "failed", f"{UNKNOWN_PEER}: {reason}", "unknown_peer")

    def post_aux(self, peer: Peer, want: wire.Want, room: int, aux_row: int) -> Write:
        local, remote = np.array([aux_row], np.int32), np.array([want.dst_aux_slot], np.int32)
        tag = wire.notif_tag(room)
        return self._poster.post(self._local_aux, local, peer.lists.aux, remote, tag, AUX_ROW_BYTES)

    def why_no_handshake(self) -> str | None:
        return summary(self._refused, self._clock())
