"""Which DP rank serves a request, the rooms kept for ``/query_dp_ranks``, and the rank link's
codec (the engine's own types, no pickle)."""

from __future__ import annotations

from array import array

import pytest

from prefill_worker.dp import wire
from prefill_worker.dp.place import RankOutOfRange, RoomRanks, place
from prefill_worker.load import CostSignals, LoadSnapshot
from prefill_worker.request import (
    FinishReason,
    Outcome,
    OutcomeStatus,
    PrefillRequest,
    SamplingParams,
    Timings,
)


def test_the_room_decides_unless_the_router_named_a_rank() -> None:
    assert [place(room, 3) for room in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert place(4, 3, named=2) == 2
    assert place(4, 3, named=0) == 0
    with pytest.raises(RankOutOfRange, match="dp_rank 3 is not in"):
        place(4, 3, named=3)
    with pytest.raises(RankOutOfRange):
        place(4, 3, named=-1)


def test_rooms_answer_a_query_and_the_oldest_are_forgotten() -> None:
    rooms = RoomRanks(capacity=2)
    rooms.record(10, 1)
    rooms.record(11, 0)
    assert rooms.query([10, 11, 12]) == {"10": 1, "11": 0}
    rooms.record(10, 1)  # recorded again: now the newest
    rooms.record(12, 1)
    assert len(rooms) == 2
    assert rooms.rank_of(11) is None and rooms.rank_of(10) == 1 and rooms.rank_of(12) == 1


def test_the_link_carries_requests_outcomes_and_loads_whole() -> None:
    request = PrefillRequest(
        "c:1", array("i", [5, 6, 7]), SamplingParams(top_k=2), True, 42, 1.5, deadline_s=3.0
    )
    back = wire.decode_to_rank(wire.encode(wire.Submit(request)))
    assert isinstance(back, wire.Submit) and back.request == request
    assert isinstance(back.request.token_ids, array)
    outcome = Outcome("c:1", OutcomeStatus.OK, FinishReason.OK, 3, first_token_id=9,
                      timings=Timings(queue_s=0.5), prompt_logprobs=(-1.0, -2.0))  # fmt: skip
    assert wire.decode_to_leader(wire.encode(wire.Done(outcome))) == wire.Done(outcome)
    load = LoadSnapshot(num_waiting=2, costs=CostSignals(queued_tokens=7))
    assert wire.decode_to_leader(wire.encode(wire.Load(load))) == wire.Load(load)
