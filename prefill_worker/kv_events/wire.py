"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``, vLLM 0.34.0): the Structs.

This is the format cache-aware routers already ingest (Dynamo's KV router and standalone
indexer, llm-d's KV cache manager); field names, their order, the tags and the encoding
options are the contract, so they follow vLLM 0.34.0 exactly (a superset of vLLM 0.31.0's,
which Dynamo 1.6.1 pins: 0.34 adds ``lookahead_token_ids``, which we never set).
The frames of one PUB message and each event's fields are tabled in docs/kv-events.md ("Wire
format"). The batch is array-like; events are tagged maps with ``omit_defaults`` (fields
without a default, such as ``lora_id``, ``medium``, ``lora_name``, are always written). Block
hashes are unsigned 64-bit ints (what ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` publishes and
what every consumer reads).

Every ``BlockStored`` names its KV-cache group as vLLM 0.34 does (``group_idx``, and the
group's ``kv_cache_spec_kind``; ``kv_cache_spec_sliding_window`` only for a sliding group,
which the worker never announces), every ``BlockRemoved`` its ``group_idx``: routers that
tell groups apart (llm-d's precise prefix scorer) score only the full-attention kinds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# vLLM 0.34's ``KVCacheSpecKind`` values for the groups this worker announces (a dense
# model's attention, an MLA or DSA model's latent; vLLM names gpt-oss's and Gemma 3's full
# layers ``full_attention`` too: their sinks are not its ``sink_full_attention``, which is
# the static-sink attention of other models).
FULL_ATTENTION = "full_attention"
MLA_ATTENTION = "mla_attention"
PREFIX_KINDS = frozenset({FULL_ATTENTION, MLA_ATTENTION, "sink_full_attention"})
"""The kinds whose blocks are a reusable prefix (what llm-d's scorer accepts)."""


@dataclass(frozen=True, slots=True)
class EventGroup:
    """A KV-cache group the worker announces: vLLM's index of the group (its numbering of
    the model's groups, ``transfer/vllm/groups.py``) and vLLM's name of its kind."""

    idx: int
    kind: str

    def __post_init__(self) -> None:
        if self.idx < 0 or self.kind not in PREFIX_KINDS:
            raise ValueError(f"group {self.idx} of kind {self.kind!r} is no prefix to announce")


DENSE = (EventGroup(0, FULL_ATTENTION),)
"""A model of one full-attention group: every layer's KV in group 0."""


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def block_stored(
    block_hashes: list[int],
    parent_block_hash: int | None,
    token_ids: list[int],
    block_size: int,
    group: EventGroup = DENSE[0],
) -> BlockStored:
    """A stored event as this worker writes it: no LoRA, the device tier, ``group``'s index
    and kind (no sliding window: a full-attention group has none)."""
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent_block_hash,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        group_idx=group.idx,
        kv_cache_spec_kind=group.kind,
    )


def block_removed(block_hashes: list[int], group: EventGroup = DENSE[0]) -> BlockRemoved:
    """vLLM's removal names the group alone (its kind came with the store)."""
    return BlockRemoved(block_hashes=block_hashes, medium=MEDIUM_GPU, group_idx=group.idx)


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
