"""KV events for cache-aware routers: the prefix cache's block events, published in vLLM's
``KVEventBatch`` format on ZMQ PUB with a replay socket (``docs/kv-events.md``)."""

from prefill_worker.kv_events.publisher import (
    KVEventPublisher,
    KVEventsError,
    KVEventsObserver,
    NullKVEventsObserver,
)

__all__ = ["KVEventPublisher", "KVEventsError", "KVEventsObserver", "NullKVEventsObserver"]
