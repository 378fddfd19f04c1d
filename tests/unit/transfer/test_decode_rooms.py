"""The decode SDK's rooms hand the worker's span over (docs/observability.md): the
``traceparent`` of the worker's status ends up in the room's ``RoomStatus``, whichever of the
status and the aux row's landing comes last."""

from __future__ import annotations

from prefill_worker.transfer import wire
from prefill_worker.transfer.decode.rooms import RoomState, RoomStatus, RoomTable

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def table() -> tuple[RoomTable, dict[int, RoomStatus]]:
    ended: dict[int, RoomStatus] = {}
    rooms = RoomTable(lambda room, status: ended.__setitem__(room, status))
    for room in (1, 2, 3):
        rooms.add(room, wire.Want.of(room, [0], 0, 0), 60.0, wire.notif_tag(room))
    return rooms, ended


def test_the_workers_traceparent_reaches_the_rooms_status() -> None:
    rooms, ended = table()
    rooms.on_status(1, wire.Status(1, "ok", traceparent=PARENT))
    rooms.on_landed(wire.notif_tag(1))  # done once both came: the status first
    rooms.on_landed(wire.notif_tag(2))
    rooms.on_status(2, wire.Status(2, "ok", traceparent=PARENT))  # the landing first
    rooms.on_status(3, wire.Status(3, "failed", "refused", traceparent=PARENT))
    assert ended[1] == RoomStatus(RoomState.DONE, None, PARENT)
    assert ended[2] == RoomStatus(RoomState.DONE, None, PARENT)
    assert ended[3] == RoomStatus(RoomState.FAILED, "refused", PARENT)


def test_a_worker_that_sends_none_leaves_it_none() -> None:
    rooms, ended = table()
    rooms.on_status(1, wire.Status(1, "ok"))
    rooms.on_landed(wire.notif_tag(1))
    rooms.on_status(2, wire.Status(2, "aborted", "bye"))
    assert ended[1] == RoomStatus(RoomState.DONE)
    assert ended[2] == RoomStatus(RoomState.ABORTED, "bye")
