"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``, vLLM 0.31.0): the Structs.

This is the format cache-aware routers already ingest (Dynamo's KV router and standalone
indexer, llm-d's KV cache manager); field names, their order, the tags and the encoding
options are the contract, so they follow vLLM 0.31.0 exactly (the version Dynamo 1.6.1 pins).
The frames of one PUB message and each event's fields are tabled in docs/kv-events.md ("Wire
format"). The batch is array-like; events are tagged maps with ``omit_defaults`` (fields
without a default, such as ``lora_id``, ``medium``, ``lora_name``, are always written). Block
hashes are unsigned 64-bit ints (what ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` publishes and
what every consumer reads).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
"""The storage tier of a block in the worker's own KV pool (vLLM's name for the device tier;
the worker says it on CPU too: it is the pool requests are served from)."""

DATA_PARALLEL_RANK = 0
"""One worker is one engine: always rank 0. Written, not omitted: Dynamo reads the batch as a
3-element array."""

END_OF_REPLAY_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's last reply to a request."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name: the class names below are part of the wire."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one prompt entered the cache; ``parent_block_hash`` is the
    block before the first of them (None at the prompt's start)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def block_stored(
    block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int], block_size: int
) -> BlockStored:
    """A stored event as this worker writes it: no LoRA, the device tier."""
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
    )


def block_removed(block_hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=MEDIUM_GPU)


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(events: list[KVEvent], ts: float | None = None) -> bytes:
    """The msgpack payload of one batch; raises ``TypeError``/``OverflowError`` on an event
    that cannot be written (an id outside 64 bits, a field of the wrong type)."""
    batch = KVEventBatch(
        ts=time.time() if ts is None else ts,
        events=events,
        data_parallel_rank=DATA_PARALLEL_RANK,
    )
    return _ENCODER.encode(batch)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
