"""The push hub of one attention-DP rank (both dialects): a decode's want for a room another
rank serves fails at once with that rank (``dp.place.rank_rule``), counted; its own rooms and
rooms whose request is already here bind as at DP 1 (docs/parallelism.md)."""

from __future__ import annotations

import pytest

from prefill_worker.dp.place import rank_rule, serve_own_rooms
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.push.hub import HubBackend
from tests.unit.transfer.test_push_hub_pins import spy, want
from tests.unit.transfer.test_push_sender import Rig


@pytest.fixture(params=["native", "sglang"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return Rig(request.param)


def test_a_want_for_another_ranks_room_fails_with_the_rank_to_ask(rig: Rig) -> None:
    rig.hub.elsewhere = rank_rule(1, 2)  # this is rank 1 of 2: odd rooms
    sent = spy(rig)
    rig.hub.want(rig.peer, want(8))
    why = (
        "this room is served by attention-DP rank 0 of 2, not rank 1: ask that rank "
        "(SGLang: prefill_dp_rank 0, or /query_dp_ranks)"
    )
    assert sent == [("decode-1", wire.Status(8, "failed", why, "wrong_dp_rank"))]
    assert rig.hub.counter.counts == {"wrong_dp_rank": 1}
    assert rig.hub.rooms.take(8) == []  # nothing waits for a request that never comes
    rig.hub.want(rig.peer, want(9))  # its own room waits for its request, as at DP 1
    assert len(sent) == 1
    sender = rig.hub.create_sender(9, "req-9", 16)
    assert sender.poll() is KVPoll.READY
    rig.hub.check_integrity()


def test_one_rank_serves_every_room_unless_told_otherwise(rig: Rig) -> None:
    sent = spy(rig)
    for room in (2, 3):
        rig.hub.want(rig.peer, want(room, (room,)))
    assert sent == [] and rig.hub.counter.counts == {}
    assert [rank_rule(r, 3)(7) is None for r in range(3)] == [False, True, False]


def test_a_backend_is_told_its_rooms(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    backend: HubBackend[object] = HubBackend()
    backend._hub = rig.hub
    serve_own_rooms(backend, 0, 4)  # type: ignore[arg-type]
    refusal = rig.hub.elsewhere(5)
    assert refusal is not None and "rank 1 of 4, not rank 0" in refusal.message
    assert rig.hub.elsewhere(8) is None
    serve_own_rooms(object(), 2, 4)  # type: ignore[arg-type]  # wrapped: told, not refused
    assert "dp rank 2: its backend cannot refuse other ranks' rooms" in caplog.text
