"""What an ``Engine`` is built from, besides its runner, backend and sink: two records.

``EngineLimits`` holds the sizes, budgets and timeouts (the config's ``cache.page_size`` and
``scheduler`` section); ``EngineKV`` the KV bookkeeping the engine owns (page pool, aux rows,
and the prefix cache over that pool, if any).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.pins import PagePins
from prefill_worker.kv.prefix_cache import PrefixCache
from prefill_worker.kv.sliding import SlidingPageTable


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Sizes, per-turn budgets and deadlines of one engine."""

    page_size: int  # tokens per KV page
    chunk_size: int  # most prompt tokens of one request in one forward
    max_batch_tokens: int  # most tokens in one forward
    max_running_requests: int  # most requests prefilling at once
    bootstrap_timeout_s: float  # from arrival to the decode peer's handshake
    transfer_timeout_s: float  # from the last chunk's forward to every KV byte landed
    poll_budget: int = 32  # bootstrap/waiting senders polled per turn
    max_messages_per_turn: int = 256  # inbox messages taken per turn
    optimistic_prefill: bool = True  # prefill before the decode's want (``handoff``)
    optimistic_attempts: int = 2  # admissions before the want, then it waits as before
    optimistic_hold_s: float = 1.0  # a finished prefill waits this long for its want
    optimistic_share: float = 0.25  # of a forward's tokens, running requests, pages (``admission``)


@dataclass(frozen=True, slots=True)
class EngineKV:
    """The page pool and aux rows the engine allocates from; ``prefix_cache`` and ``pins``
    are over ``pages`` (None: no prefix cache, no pins); ``sliding``: a windowed sliding
    pool's bookkeeping (``kv.sliding``; None: the sliding layers share ``pages``)."""

    pages: PagePool
    aux: AuxPool
    prefix_cache: PrefixCache | None = None
    sliding: SlidingPageTable | None = None
    pins: PagePins | None = None  # pages transfers keep past their requests (kv.pins)
