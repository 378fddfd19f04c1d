"""The configuration's schema: the whole ``Config``, its sections (``service/sections/``: one
pydantic model each, with defaults, bounds and the descriptions ``docs/config.md`` is rendered
from) and the rules that span sections. Reading files and env is ``config.py``'s job.
"""

from __future__ import annotations

from pydantic import model_validator

from prefill_worker.service.sections.base import Section
from prefill_worker.service.sections.endpoints import (
    HttpApiConfig,
    IngressConfig,
    KVEventsConfig,
    MetricsConfig,
)
from prefill_worker.service.sections.engine import (
    AdmissionConfig,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
)
from prefill_worker.service.sections.process import DaemonConfig, ParallelConfig
from prefill_worker.service.sections.tracing import TracingConfig
from prefill_worker.service.sections.transfer import PROTOCOLS, TransferConfig, protocols_of


class Config(Section):
    """The whole configuration; only the daemon sees all of it."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    ingress: IngressConfig = IngressConfig()
    transfer: TransferConfig = TransferConfig()
    metrics: MetricsConfig = MetricsConfig()
    http_api: HttpApiConfig = HttpApiConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    parallel: ParallelConfig = ParallelConfig()
    daemon: DaemonConfig = DaemonConfig()
    tracing: TracingConfig = TracingConfig()

    @model_validator(mode="after")
    def _vllm_needs_the_http_front(self) -> Config:
        if "vllm" in self.transfer.protocols and not self.http_api.enabled:
            raise ValueError(
                "transfer.protocol vllm: vLLM's proxy reaches this worker over HTTP; set "
                "http_api.enabled"
            )
        return self

    @model_validator(mode="after")
    def _tp_serves_one_push_protocol(self) -> Config:
        """At TP > 1 only a desk that leads the group has every rank push its heads (native,
        or SGLang's, alone: docs/parallelism.md), and vLLM's pulls read every rank's heads
        from the region the group shares (alone: docs/vllm.md); any other choice would offer
        decodes the leader's heads only."""
        protocols = self.transfer.protocols
        if self.parallel.tp_size > 1 and protocols not in (("native",), ("sglang",), ("vllm",)):
            raise ValueError(
                f"transfer.protocol {self.transfer.protocol!r} at parallel.tp_size "
                f"{self.parallel.tp_size}: a tensor-parallel worker serves native, sglang or "
                "vllm alone"
            )
        return self

    @model_validator(mode="after")
    def _dp_ranks_are_whole_workers(self) -> Config:
        """Attention DP ranks (docs/parallelism.md): each a TP-1 worker pushing its own KV by
        a protocol whose desk it runs itself; DP x TP, vLLM's pulls and one KV-event stream
        per rank are not built."""
        dp_size = self.parallel.dp_size
        if dp_size == 1:
            return self
        if self.parallel.tp_size > 1:
            raise ValueError(f"parallel.dp_size {dp_size} with tp_size > 1: not built yet")
        if self.transfer.protocols not in (("native",), ("sglang",)):
            raise ValueError(
                f"transfer.protocol {self.transfer.protocol!r} at parallel.dp_size {dp_size}: "
                "an attention-DP worker serves native or sglang alone"
            )
        if self.kv_events.enabled:
            raise ValueError(f"kv_events.enabled at parallel.dp_size {dp_size}: not built yet")
        return self

    @model_validator(mode="after")
    def _vllm_tp_stages_on_one_host(self) -> Config:
        """At TP > 1 vLLM's blocks are a region the ranks share in memory (docs/vllm.md,
        "Workers with TP > 1"): the group runs on one host."""
        tp_size = self.parallel.tp_size
        if tp_size > 1 and "vllm" in self.transfer.protocols and self.parallel.interface:
            raise ValueError(
                f"transfer.protocol vllm at parallel.tp_size {tp_size}: the ranks share the "
                "staging region in memory, so the group runs on one host; unset "
                "parallel.interface"
            )
        return self

    @model_validator(mode="after")
    def _vllm_blocks_pool(self) -> Config:
        """A pool in vLLM's block layout (``cache.layout: vllm_blocks``, docs/vllm.md): a page
        is one vLLM block, so the decodes' block size is the page size; SGLang decodes'
        pages keep K and V apart, token-major, which from this pool would be a descriptor per
        head per token: refused."""
        if self.cache.layout != "vllm_blocks":
            return self
        protocols, block_size = self.transfer.protocols, self.transfer.vllm_block_size
        if "sglang" in protocols:
            raise ValueError(
                "cache.layout vllm_blocks with transfer.protocol sglang: SGLang decodes keep K "
                "and V apart, token by token, so each head of each token would be a transfer "
                "descriptor; use layer_major or page_major for SGLang decodes"
            )
        if "vllm" in protocols and block_size != self.cache.page_size:
            raise ValueError(
                f"cache.layout vllm_blocks with transfer.vllm_block_size {block_size}: a page "
                f"is one vLLM block; set cache.page_size {self.cache.page_size} and "
                "vllm_block_size (the decodes' --block-size) equal"
            )
        return self

    @model_validator(mode="after")
    def _decodes_agree_on_the_kv_dtype(self) -> Config:
        """An FP8 pool's pages land byte for byte in the decode's pool, so each protocol's
        handshake must say so: SGLang decodes compare ``/route``'s ``kv_cache_dtype`` with
        their ``--kv-cache-dtype``; vLLM decodes hash their model dtype and their
        ``kv_cache_dtype`` (``transfer.vllm_kv_cache_dtype``)."""
        fp8, protocols = self.cache.kv_dtype == "fp8_e4m3", self.transfer.protocols
        announced = self.transfer.sglang_kv_cache_dtype
        if "sglang" in protocols and fp8 != (announced == "fp8_e4m3"):
            raise ValueError(
                f"cache.kv_dtype {self.cache.kv_dtype!r} with transfer.sglang_kv_cache_dtype "
                f"{announced!r}: SGLang decodes read the pages as their --kv-cache-dtype says; "
                f"set both to fp8_e4m3, or neither"
            )
        if "vllm" in protocols:
            self._vllm_decodes_read_the_pool(fp8)
        return self

    def _vllm_decodes_read_the_pool(self, fp8: bool) -> None:
        """vLLM decodes hash their model dtype and their ``kv_cache_dtype`` string apart."""
        cache_dtype = self.transfer.vllm_kv_cache_dtype
        if fp8 != (cache_dtype != "auto"):
            raise ValueError(
                f"cache.kv_dtype {self.cache.kv_dtype!r} with transfer.vllm_kv_cache_dtype "
                f"{cache_dtype!r}: vLLM decodes read the blocks as their kv_cache_dtype says; "
                f"set fp8_e4m3 with fp8 (or fp8_e4m3), or auto with auto"
            )
        if fp8 and self.model.dtype == "auto":
            raise ValueError(
                "cache.kv_dtype fp8_e4m3 served to vLLM decodes needs an explicit model.dtype: "
                "their compatibility hash covers the model dtype apart from the cache's"
            )


SECTIONS: dict[str, type[Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Config.model_fields.items()
}


__all__ = [
    "PROTOCOLS",
    "SECTIONS",
    "AdmissionConfig",
    "CacheConfig",
    "Config",
    "DaemonConfig",
    "HttpApiConfig",
    "IngressConfig",
    "KVEventsConfig",
    "MetricsConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "TracingConfig",
    "TransferConfig",
    "protocols_of",
]
