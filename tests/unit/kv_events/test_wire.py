"""The payload is vLLM 0.34.0's KVEventBatch: read back with the Structs as vLLM declares them
(transcribed below from ``vllm/distributed/kv_events.py`` of the vllm 0.34.0 wheel; vLLM
0.31.0's, which Dynamo 1.6.1 pins, lacks only ``lookahead_token_ids``), and as raw msgpack,
the shape a non-Python consumer parses. The same bytes out of vLLM 0.34's own module:
``tests/interop/test_vllm_kv_events.py``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from prefill_worker.kv_events.wire import (
    AllBlocksCleared,
    EventGroup,
    block_removed,
    block_stored,
    encode_batch,
    seq_frame,
)

# ── vLLM 0.34.0's declarations (the reference; field order, tags and options are the wire) ──


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
    lookahead_token_ids: list[list[int]] | None = None


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
DENSE = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}  # a dense model's group


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
        **DENSE,
    )
    assert (second.block_hashes, second.parent_block_hash) == ([9], 7)
    assert second.token_ids == list(range(32, 48))
    assert removed == VllmBlockRemoved(block_hashes=[9, 7], medium="GPU", group_idx=0)
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_raw_msgpack_shape() -> None:
    """A batch is a 3-array; an event is a map tagged by ``type`` holding every field without a
    default (``None`` included), the group's index and kind, and no other defaulted one."""
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
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert list(events[0])[-2:] == ["group_idx", "kv_cache_spec_kind"]  # vLLM's field order
    assert events[2] == {
        "type": "BlockRemoved",
        "block_hashes": [9, 7],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert events[3] == {"type": "AllBlocksCleared"}


def test_an_empty_batch_still_carries_its_rank() -> None:
    assert msgspec.msgpack.decode(encode_batch([], ts=2.0)) == [2.0, [], 0]


def test_a_group_is_named_as_vllm_names_it() -> None:
    """gpt-oss-20b's full-attention group is vLLM's group 1 (``transfer/vllm/groups.py``); an
    MLA model's one group is ``mla_attention``. No sliding window: never a sliding group."""
    full, mla = EventGroup(1, "full_attention"), EventGroup(0, "mla_attention")
    stored, removed, latent = _DECODER.decode(
        encode_batch(
            [
                block_stored([3], None, [1, 2], 2, full),
                block_removed([3], full),
                block_stored([4], None, [5, 6], 2, mla),
            ],
            ts=1.0,
        )
    ).events
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (1, "full_attention")
    assert stored.kv_cache_spec_sliding_window is None and removed.group_idx == 1
    assert (latent.group_idx, latent.kv_cache_spec_kind) == (0, "mla_attention")


@pytest.mark.parametrize(
    ("idx", "kind"), [(0, "sliding_window"), (2, "mamba"), (-1, "full_attention"), (0, "Full")]
)
def test_only_a_prefix_group_is_announced(idx: int, kind: str) -> None:
    """A sliding page loses its early positions and a mamba block is state: neither is a
    reusable prefix, so no event may name one."""
    with pytest.raises(ValueError, match="no prefix"):
        EventGroup(idx, kind)


def test_hash_outside_64_bits_is_refused() -> None:
    with pytest.raises(OverflowError):
        encode_batch([block_removed([2**64])])


def test_sequence_frame_is_8_bytes_big_endian() -> None:
    assert seq_frame(0) == bytes(8)
    assert seq_frame(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
