"""What the decode SDK keeps per wanted room: the states a room goes through, and its record.

``RoomState`` and ``RoomStatus`` are the SDK's public vocabulary (``KVReceiver.poll`` returns a
``RoomStatus``; import them from ``transfer.receiver``); ``RoomEntry`` is the receiver's own
record of a room: what it asked for, what the worker and NIXL have said so far.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prefill_worker.transfer import wire


class RoomState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class RoomStatus:
    state: RoomState
    reason: str | None = None


@dataclass(slots=True)
class RoomEntry:
    status: RoomStatus
    want: wire.Want
    deadline: float  # PENDING past this fails
    is_status_ok: bool = False  # the worker said `status ok`
    is_landed: bool = False  # the aux row's NIXL notification arrived
    is_resend_due: bool = False  # refused as unknown_peer: send again once registered
    timed_out_reason: str | None = None  # past the deadline: aborted, failing once acked
