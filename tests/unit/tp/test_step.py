"""The step a follower receives is the plan the leader runs and the transfer ops it queued:
every forward input survives msgpack, and only whether a chunk samples (not how) goes over."""

from __future__ import annotations

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.request import SamplingParams
from prefill_worker.tp.step import decode_step, encode_step
from prefill_worker.transfer.group import MirrorOp
from prefill_worker.transfer.vllm.shared import Stage


def test_a_plan_round_trips_with_its_forward_inputs() -> None:
    plan = BatchPlan(
        7,
        (
            ChunkPlan("a", (5, 6, 7), 16, 19, (3, 9, 1, 4, 8), None, 17, (7, 8)),
            ChunkPlan(
                "b", (1, 2), 0, 2, (2,), SamplingParams(temperature=0.7, seed=3), state_slot=3
            ),
            ChunkPlan("c", (4, 4), 30, 32, (5, 6), None, mirror_slots=(70, 71)),
            ChunkPlan("d", (1,), 40, 41, (1, 2, 3), None, sliding_page_ids=(-1, 4, 0)),
        ),
    )
    got = decode_step(encode_step(plan)).plan
    assert got is not None and got.batch_id == 7
    for sent, received in zip(plan.chunks, got.chunks, strict=True):
        assert received.request_id == sent.request_id
        assert tuple(received.token_ids) == tuple(sent.token_ids)
        assert (received.start, received.end) == (sent.start, sent.end)
        assert tuple(received.page_ids) == tuple(sent.page_ids)
        assert (received.sampling is None) == (sent.sampling is None)
        assert received.logprob_from == sent.logprob_from
        assert tuple(received.logprob_token_ids) == tuple(sent.logprob_token_ids)
        assert tuple(received.mirror_slots) == tuple(sent.mirror_slots)  # every rank mirrors
        assert received.state_slot == sent.state_slot  # a hybrid: every rank's pool, its heads
        assert tuple(received.sliding_page_ids) == tuple(sent.sliding_page_ids)  # windowed


def test_vllm_stages_round_trip_in_order() -> None:
    """The leader's vLLM repacks each follower runs for its heads (``transfer/vllm/shared``)."""
    stages = [Stage([4, 9], 2, [0, 1, 5], 70, 100), Stage([1], 0, [3], 0, 7)]
    step = decode_step(encode_step(None, (), (), stages))
    assert list(step.stages) == stages and step.plan is None
    assert list(decode_step(encode_step(None)).stages) == []


def test_ops_and_rooms_round_trip_in_order() -> None:
    ops = [
        MirrorOp("create", 5, "r", 40, "decode-1"),
        MirrorOp("pages", 5, page_ids=[9, 2], first=3),
        MirrorOp("aux", 5, first=4),
        MirrorOp("fail", 6, reason="gone"),
        MirrorOp("close", 6),
    ]
    step = decode_step(encode_step(None, ops, [5, 6]))
    assert step.plan is None and list(step.ops) == ops and list(step.rooms) == [5, 6]


def test_the_bytes_are_msgpack_not_pickle() -> None:
    data = encode_step(BatchPlan(1, (ChunkPlan("a", (1,), 0, 1, (0,), None),)))
    assert not data.startswith(b"\x80")  # pickle's protocol marker
    assert data[0] >> 4 == 0x9  # a msgpack fixarray: [plan, ops, rooms]
