"""vLLM 0.34's own KV events for the layers of a model, as JSON on stdout (run in the vLLM
interop environment by ``test_vllm_kv_events.py``).

Reads ``{"block_size", "ts", "events", "models": {name: [layer, ...]}, "kinds"}`` on stdin, a
layer being ``full``, ``sliding:<window>``, ``mla`` or ``indexer`` (a DSA model's index keys).
For each model: its KV-cache groups from vLLM's own planner (``get_kv_cache_groups``, the
hybrid KV-cache manager on, layer-outermost pages as the NIXL decode has them) with each
group's kind and window (``get_kv_cache_spec_kind`` and ``_sliding_window``), and the batch
vLLM publishes for the events: a stored run or a removal once per group, built as its
``BlockPool`` builds them and annotated as ``KVCacheManager.take_events`` does, keeping the
groups whose kind is in ``kinds``; encoded with its publisher's encoder, base64."""

from __future__ import annotations

import base64
import json
import sys
import types

import msgspec
import torch
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import to_event_extra_keys
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)

_CONFIG = types.SimpleNamespace(
    scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    cache_config=types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: types.SimpleNamespace(is_block_outermost=False)
    ),
)


def spec(layer: str, block_size: int) -> KVCacheSpec:
    kind, _, window = layer.partition(":")
    heads = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    if kind == "full":
        return FullAttentionSpec(block_size=block_size, **heads)
    if kind == "sliding":
        return SlidingWindowSpec(block_size=block_size, sliding_window=int(window), **heads)
    latent = {"num_kv_heads": 1, "dtype": torch.bfloat16}
    if kind == "mla":
        return MLAAttentionSpec(block_size=block_size, head_size=576, **latent)
    assert kind == "indexer", layer
    return MLAAttentionSpec(
        block_size=block_size,
        head_size=132,
        max_tp_shards=1,
        cache_role=SparseCacheRole.INDEXER,
        **latent,
    )


def published(events: list[dict], groups: list[tuple[str, int | None]], kinds: set[str]):
    out: list[KVCacheEvent] = []
    for event in events:
        if event["type"] == "AllBlocksCleared":
            out.append(AllBlocksCleared())
            continue
        for group_idx, (kind, window) in enumerate(groups):
            if kind not in kinds:
                continue
            if event["type"] == "BlockRemoved":
                out.append(BlockRemoved(event["block_hashes"], "GPU", group_idx=group_idx))
                continue
            stored = BlockStored(
                block_hashes=event["block_hashes"],
                parent_block_hash=event["parent_block_hash"],
                token_ids=event["token_ids"],
                block_size=event["block_size"],
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=to_event_extra_keys(None),
                group_idx=group_idx,
                session_id=None,
                lookahead_token_ids=None,
            )
            stored.kv_cache_spec_kind = kind
            stored.kv_cache_spec_sliding_window = window
            out.append(stored)
    return out


def main() -> None:
    request = json.load(sys.stdin)
    block_size, kinds = request["block_size"], set(request["kinds"])
    encoder = msgspec.msgpack.Encoder()  # as ZmqEventPublisher's
    models = {}
    for name, layers in request["models"].items():
        specs = {f"model.layers.{i}": spec(layer, block_size) for i, layer in enumerate(layers)}
        groups = [
            (
                get_kv_cache_spec_kind(g.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(g.kv_cache_spec),
            )
            for g in get_kv_cache_groups(_CONFIG, specs)
        ]
        events = published(request["events"], groups, kinds)
        batch = KVEventBatch(ts=request["ts"], events=events, data_parallel_rank=0)
        payload = base64.b64encode(encoder.encode(batch)).decode()
        models[name] = {"groups": groups, "payload": payload}
    kind_values = [kind.value for kind in KVCacheSpecKind]
    json.dump({"models": models, "kinds": kind_values}, sys.stdout)


if __name__ == "__main__":
    main()
