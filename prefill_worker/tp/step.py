"""What the leader tells every follower each step, as msgpack bytes (never pickle).

A step is one of::

    FORWARD    a batch's forward inputs: the ``BatchPlan`` (page ids, tokens, positions,
               KV mirror slots, a hybrid model's state slots; whether a chunk samples,
               but not how: only the leader samples)
    HEARTBEAT  nothing to run: proves every rank still answers while the worker is idle,
               and carries transfer ops when the group is otherwise free
    STOP       the leader is closing: followers leave their loop and exit 0

Every step's body also carries the transfer ops queued since the last step and the rooms
whose state the ranks agree on after it (``transfer/group.py``, ``tp/mirror.py``), and the
vLLM repacks each follower runs for its heads before the forward (``transfer/vllm/shared``).
Torch-free; ``channel.py`` carries the bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.request import SamplingParams
from prefill_worker.transfer.group import MirrorOp
from prefill_worker.transfer.vllm.shared import Stage


class StepKind(enum.IntEnum):
    FORWARD = 1
    HEARTBEAT = 2
    STOP = 3


class _Chunk(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    token_ids: list[int]
    start: int
    end: int
    page_ids: list[int]
    samples: bool
    logprob_from: int
    logprob_token_ids: list[int]
    mirror_slots: list[int] = []  # where each token's K/V also goes: every rank's KV mirror
    state_slot: int | None = None  # a hybrid model's state slot: every rank's pool holds its heads
    sliding_page_ids: list[int] = []  # a windowed sliding pool's entries (``kv.sliding``)


class _Plan(msgspec.Struct, array_like=True, frozen=True):
    batch_id: int
    chunks: list[_Chunk]


class _Body(msgspec.Struct, array_like=True, frozen=True):
    plan: _Plan | None
    ops: list[MirrorOp]
    rooms: list[int]
    stages: list[Stage] = []


@dataclass(frozen=True, slots=True)
class Step:
    plan: BatchPlan | None  # FORWARD only
    ops: Sequence[MirrorOp]
    rooms: Sequence[int]
    stages: Sequence[Stage] = ()  # vLLM repacks each follower runs before the forward


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Body)
_FOLLOWER_SAMPLING = SamplingParams()  # a follower only needs to know that a chunk samples


def encode_step(
    plan: BatchPlan | None,
    ops: Sequence[MirrorOp] = (),
    rooms: Sequence[int] = (),
    stages: Sequence[Stage] = (),
) -> bytes:
    wire = None if plan is None else _plan_to_wire(plan)
    return _encoder.encode(_Body(wire, list(ops), list(rooms), list(stages)))


def decode_step(data: bytes) -> Step:
    """The step as a follower runs it: the same forward inputs, a placeholder sampling."""
    body = _decoder.decode(data)
    plan = None if body.plan is None else _plan_from_wire(body.plan)
    return Step(plan, body.ops, body.rooms, body.stages)


def _plan_to_wire(plan: BatchPlan) -> _Plan:
    chunks = [
        _Chunk(
            c.request_id,
            list(c.token_ids),
            c.start,
            c.end,
            list(c.page_ids),
            c.sampling is not None,
            c.logprob_from,
            list(c.logprob_token_ids),
            list(c.mirror_slots),
            c.state_slot,
            list(c.sliding_page_ids),
        )
        for c in plan.chunks
    ]
    return _Plan(plan.batch_id, chunks)


def _plan_from_wire(wire: _Plan) -> BatchPlan:
    chunks = tuple(
        ChunkPlan(
            c.request_id,
            tuple(c.token_ids),
            c.start,
            c.end,
            tuple(c.page_ids),
            _FOLLOWER_SAMPLING if c.samples else None,
            c.logprob_from,
            tuple(c.logprob_token_ids),
            tuple(c.mirror_slots),
            c.state_slot,
            sliding_page_ids=tuple(c.sliding_page_ids),
        )
        for c in wire.chunks
    )
    return BatchPlan(wire.batch_id, chunks)
