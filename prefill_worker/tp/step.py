"""What the leader tells every follower each step, as msgpack bytes (never pickle).

A step is one of::

    FORWARD    a batch's forward inputs: the ``BatchPlan`` (page ids, tokens, positions;
               whether a chunk samples, but not how: only the leader samples)
    HEARTBEAT  nothing to run: proves every rank still answers while the worker is idle
    STOP       the leader is closing: followers leave their loop and exit 0

Torch-free; ``channel.py`` carries the bytes.
"""

from __future__ import annotations

import enum

import msgspec

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.request import SamplingParams


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


class _Plan(msgspec.Struct, array_like=True, frozen=True):
    batch_id: int
    chunks: list[_Chunk]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Plan)
_FOLLOWER_SAMPLING = SamplingParams()  # a follower only needs to know that a chunk samples


def encode_plan(plan: BatchPlan) -> bytes:
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
        )
        for c in plan.chunks
    ]
    return _encoder.encode(_Plan(plan.batch_id, chunks))


def decode_plan(data: bytes) -> BatchPlan:
    """The plan as a follower runs it: the same forward inputs, a placeholder sampling."""
    wire = _decoder.decode(data)
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
        )
        for c in wire.chunks
    )
    return BatchPlan(wire.batch_id, chunks)
