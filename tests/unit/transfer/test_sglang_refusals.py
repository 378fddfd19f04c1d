"""The rooms a refused decode asked for: taken once, forgotten after ``keep_s``, bounded."""

from __future__ import annotations

from prefill_worker.transfer.sglang.refusals import RefusedRooms


def test_a_refused_room_is_taken_once_within_its_time() -> None:
    rooms = RefusedRooms(keep_s=5.0)
    rooms.add(7, "decode-a", "registration refused: page size", now=0.0)
    rooms.add(8, "decode-a", "registration refused: page size", now=0.0)
    refused = rooms.take(7, now=4.9)
    assert refused is not None and refused.agent_name == "decode-a"
    assert rooms.take(7, now=4.9) is None
    assert rooms.take(8, now=5.0) is None  # past keep_s


def test_what_an_unregistered_sender_leaves_is_bounded() -> None:
    rooms = RefusedRooms(keep_s=5.0, max_rooms=3)
    for room in range(10):
        rooms.add(room, "spammer", "decode not registered", now=0.0)
    assert len(rooms) == 3
    assert rooms.take(0, now=1.0) is None and rooms.take(9, now=1.0) is not None
