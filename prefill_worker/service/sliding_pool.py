"""``cache.sliding_pool``: the windowed sliding pool's size and bytes (for ``check-config``),
and the start-up rule that refuses it while no transfer reads it (docs/models.md, "The
sliding-window pool"). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from prefill_worker.kv.sliding import max_pages_per_request
from prefill_worker.model.hf_config import read_spec
from prefill_worker.model.hf_sliding import SlidingSpec
from prefill_worker.service.schema import Config

WINDOWED = "windowed"
SERVED_PROTOCOLS = ("native", "sglang", "vllm")  # read the sliding layers' own page space


def windowed_refusal(config: Config) -> str | None:
    """Why ``cache.sliding_pool windowed`` cannot start with this config, or None. The
    native protocol (decodes of any TP size, from a worker of any TP or DP size), SGLang's
    (its decodes with a hybrid SWA pool) and vLLM 0.34's pulls (its sliding KV-cache groups,
    ``vllm_refusal``), these two at worker TP 1 and DP 1, read the sliding layers' own page
    space (docs/models.md, 'The sliding-window pool')."""
    if config.cache.sliding_pool != WINDOWED:
        return None
    vllm = vllm_refusal(config) if "vllm" in config.transfer.protocols else None
    if vllm is not None:
        return vllm
    others = [p for p in config.transfer.protocols if p not in SERVED_PROTOCOLS]
    if others:
        return (
            f"cache.sliding_pool windowed: the {', '.join(others)} protocol's transfers do not "
            "read the sliding layers' own page space yet (only native's and sglang's), so a "
            "windowed worker would send its decodes the wrong pages; "
            "use sliding_pool full (docs/models.md, 'The sliding-window pool')"
        )
    parallel = config.parallel
    is_parallel = parallel.tp_size > 1 or parallel.dp_size > 1
    if is_parallel and list(config.transfer.protocols) != ["native"]:
        return (
            f"cache.sliding_pool windowed at parallel.tp_size {parallel.tp_size}, dp_size "
            f"{parallel.dp_size}: served over native alone (a TP group's ranks, or DP ranks, "
            "send their sliding pages to native decodes only); use sliding_pool full"
        )
    return None


def vllm_refusal(config: Config) -> str | None:
    """Why a windowed pool cannot serve this config's vLLM decodes, or None: served from a
    ``layer_major`` pool (its staging region, ``transfer/vllm/window_staging.py``) at worker TP
    1. A request in push mode, or naming a version without KV-cache groups (0.33), is
    refused per request, as from a full pool (``Tickets.why_refused``)."""
    why = None
    if config.cache.layout != "layer_major":
        why = f"cache.layout {config.cache.layout}: vLLM decodes are staged from a layer_major pool"
    elif config.parallel.tp_size > 1 or config.parallel.dp_size > 1:
        why = "vLLM decodes are staged from it at parallel.tp_size 1 and dp_size 1 only"
    return None if why is None else f"cache.sliding_pool windowed: {why}; or use sliding_pool full"


def windowed_pages(config: Config) -> int:
    """The windowed sliding pool's page count for ``config``'s model (read from its
    checkpoint's config; ``ValueError`` for a model without sliding layers)."""
    spec = read_spec(config.model.path)
    if spec.sliding is None:
        raise ValueError("cache.sliding_pool windowed: the model has no sliding-window layers")
    return sliding_pool_size(config, spec.sliding).num_pages


@dataclass(frozen=True, slots=True)
class SlidingPoolSize:
    """A windowed sliding pool: its pages, each request's quota, the layers it holds."""

    num_pages: int
    quota: int  # pages one prefilling request may hold
    num_sliding_layers: int
    num_full_layers: int

    def bytes_per_page(self, layer_page_bytes: int) -> int:
        """K and V of every sliding layer for one of its pages (``layer_page_bytes``: one
        layer's K, or V, page)."""
        return 2 * self.num_sliding_layers * layer_page_bytes


def sliding_pool_size(config: Config, sliding: SlidingSpec) -> SlidingPoolSize:
    """``cache.sliding_pages``, or one quota per ``scheduler.max_running_requests``."""
    cache, sched = config.cache, config.scheduler
    quota = max_pages_per_request(sliding.window, sched.chunk_size, cache.page_size)
    num_pages = cache.sliding_pages or quota * sched.max_running_requests
    num_sliding = len(sliding.sliding_layers)
    return SlidingPoolSize(num_pages, quota, num_sliding, len(sliding.layer_kinds) - num_sliding)


def sliding_pool_note(size: SlidingPoolSize, layer_page_bytes: int, page_size: int) -> str:
    num_bytes = size.num_pages * size.bytes_per_page(layer_page_bytes)
    return (
        f"sliding pool (windowed): {size.num_sliding_layers} sliding layers × {size.num_pages} "
        f"pages of {page_size} tokens (quota {size.quota} pages a request: window - 1 and two "
        f"chunks) = {num_bytes / 2**30:.2f} GiB beside the pool, which holds the "
        f"{size.num_full_layers} full layers only; prefix hits at a cached chain's end, "
        "whose last window stays in the sliding pool's spare pages"
    )


def sliding_pool_problem(size: SlidingPoolSize) -> str | None:
    """Why the pool cannot serve one request, or None."""
    if size.num_pages >= size.quota:
        return None
    return (
        f"cache.sliding_pages {size.num_pages}: one request's window and two chunks need "
        f"{size.quota} pages"
    )
