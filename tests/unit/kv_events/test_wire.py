"""The payload is vLLM 0.31.0's KVEventBatch: read back with the Structs as vLLM declares them
(transcribed below from ``vllm/distributed/kv_events.py`` of the vllm 0.31.0 wheel, the version
Dynamo 1.6.1 pins), and as raw msgpack, the shape a non-Python consumer parses."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from prefill_worker.kv_events.wire import (
    AllBlocksCleared,
    block_removed,
    block_stored,
    encode_batch,
    seq_frame,
)

# ── vLLM 0.31.0's declarations (the reference; field order, tags and options are the wire) ──


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


_DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)
MAX_U64 = 2**64 - 1


def sample_events() -> list[Any]:
    return [
        block_stored([MAX_U64, 7], None, list(range(32)), 16),
        block_stored([9], 7, list(range(32, 48)), 16),
        block_removed([9, 7]),
        AllBlocksCleared(),
    ]


def test_vllm_structs_decode_the_payload() -> None:
    batch = _DECODER.decode(encode_batch(sample_events(), ts=1234.5))
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    first, second, removed, cleared = batch.events
    assert first == VllmBlockStored(
        block_hashes=[MAX_U64, 7],
        parent_block_hash=None,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    assert (second.block_hashes, second.parent_block_hash) == ([9], 7)
    assert second.token_ids == list(range(32, 48))
    assert removed == VllmBlockRemoved(block_hashes=[9, 7], medium="GPU")
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_raw_msgpack_shape() -> None:
    """A batch is a 3-array; an event is a map tagged by ``type`` holding every field without a
    default (``None`` included) and none of the defaulted ones."""
    ts, events, rank = msgspec.msgpack.decode(encode_batch(sample_events(), ts=1.0))
    assert (ts, rank) == (1.0, 0)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [MAX_U64, 7],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [9, 7], "medium": "GPU"}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_an_empty_batch_still_carries_its_rank() -> None:
    assert msgspec.msgpack.decode(encode_batch([], ts=2.0)) == [2.0, [], 0]


def test_hash_outside_64_bits_is_refused() -> None:
    with pytest.raises(OverflowError):
        encode_batch([block_removed([2**64])])


def test_sequence_frame_is_8_bytes_big_endian() -> None:
    assert seq_frame(0) == bytes(8)
    assert seq_frame(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
