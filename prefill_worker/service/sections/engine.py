"""The sections of what the engine runs: the model, its paged KV pool, the scheduler, and
admission on the fronts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prefill_worker.service.sections.base import Section


class ModelConfig(Section):
    """The checkpoint, its dtype, the device, the attention and MoE experts backends."""

    path: str = Field(
        "models/smollm2-135m",
        description="Hugging Face checkpoint directory (config.json and *.safetensors).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Weight and KV dtype; `auto` takes the checkpoint's torch_dtype."
    )
    device: str = Field("cpu", description="`cpu`, `cuda`, `cuda:N`, or `auto` (CUDA if present).")
    attention_backend: Literal["auto", "sdpa", "flashinfer"] = Field(
        "auto",
        description="`auto` picks flashinfer on CUDA when installed, else sdpa. An MLA model "
        "(DeepSeek-V3) keeps flashinfer only at DeepSeek's MLA dims (rank 512, rope 64, nope "
        "128, v 128) in bf16/fp16, and otherwise runs its torch path (docs/models.md).",
    )
    moe_backend: Literal["auto", "grouped", "naive", "flashinfer"] = Field(
        "auto",
        description=(
            "Experts of a mixture-of-experts model: `grouped` (tokens grouped by expert, torch "
            "ops, any device), `flashinfer` (fused kernel; CUDA, bf16/fp16), `naive` (every "
            "expert over every token; a baseline). `auto` picks flashinfer on CUDA in bf16/fp16 "
            "when installed, else grouped. Unused by dense models, but checked against the device."
        ),
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads on CPU; unset leaves torch's default."
    )
    draft: Literal["none", "mtp", "eagle", "eagle3"] = Field(
        "none",
        description="A draft model run after the target, for decodes that speculate (SGLang "
        "EAGLE/MTP): `mtp` runs DeepSeek-V3's own MTP layer from the checkpoint over every "
        "chunk (at any parallel.tp_size: each rank its slice and its draft heads), its KV in "
        "a one-layer pool within the KV budget, its first proposal beside the first token "
        "(docs/models.md, 'MTP draft'); `eagle`, `eagle3` run the EAGLE / EAGLE-3 draft at "
        "`draft_path` after a Llama-family target the same way (docs/models.md, 'EAGLE "
        "drafts').",
    )
    draft_path: str | None = Field(
        None,
        description="The draft checkpoint's directory (SGLang's --speculative-draft-model-path), "
        "for draft `eagle` and `eagle3`.",
    )
    draft_topk: int = Field(
        1,
        ge=1,
        le=16,
        description="Draft proposals per request (SGLang's --speculative-eagle-topk).",
    )


class CacheConfig(Section):
    """The paged KV pool (layout: docs/protocol.md, part 2) and the aux rows."""

    page_size: int = Field(16, ge=1, le=1024, description="Tokens per KV page.")
    num_pages: int | None = Field(
        1024, ge=1, description="KV pages per layer; unset sizes the pool from the byte budget."
    )
    memory_bytes: int | None = Field(
        None, ge=1, description="KV byte budget (all layers, K and V) when num_pages is unset."
    )
    memory_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="On CUDA: fraction of free device memory for KV when both above are unset.",
    )
    num_aux_rows: int = Field(
        256,
        ge=1,
        description="Metadata rows (first token, logprob) for requests in flight. A hybrid "
        "model (Qwen3-Next, Qwen3.5) has one linear-attention state slot per row, often tens "
        "of MiB each (`check-config` prints the bytes; docs/models.md).",
    )
    layout: Literal["layer_major", "page_major", "vllm_blocks"] = Field(
        "layer_major",
        description=(
            "KV pool layout: `layer_major` (each layer's K and V its own region), "
            "`page_major` (every layer's K and V of a page together: one transfer descriptor "
            "per run of pages) or `vllm_blocks` (vLLM's LBHNC blocks, a page one vLLM block: "
            "vLLM decodes push and pull straight from the pool, no staging region; "
            "page_size = transfer.vllm_block_size; no SGLang decodes; docs/vllm.md). Native "
            "decode pools must use the same. An MLA model (DeepSeek-V3) always gets the `mla` "
            "pool (one latent row per token and layer; docs/models.md) and refuses the others."
        ),
    )
    kv_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="KV pool dtype: `auto` (the model's) or `fp8_e4m3` (one byte per value, "
        "scale 1.0 or the checkpoint's k_scale/v_scale, as SGLang's and vLLM's FP8 KV caches; "
        "half the bytes a transfer moves). "
        "Decodes must run the same (SGLang: `--kv-cache-dtype fp8_e4m3`); read back by the "
        "sdpa attention backend only (docs/models.md).",
    )
    prefix_caching: bool = Field(
        True,
        description="Keep full KV pages after their request and share them with later prompts "
        "that start with the same tokens (docs/prefix-cache.md).",
    )
    prefix_cache_max_pages: int | None = Field(
        None,
        ge=0,
        description="Most KV pages the prefix cache holds; unset: as many as the pool has (idle "
        "cached pages are evicted, least recently used first, when requests need them).",
    )

    sliding_pool: Literal["full", "windowed"] = Field(
        "full",
        description="A sliding-window model's (gpt-oss, Gemma 3) sliding layers: `full` keeps "
        "their K/V for every position in the one pool (what every decode can take); "
        "`windowed` gives them their own page space holding only the window each still needs "
        "and the chunks in flight (about half a gpt-oss pool for long prompts; prefix hits "
        "only at a cached chain's end, whose window it keeps). Served over "
        "`transfer.protocol` native (decodes of any TP size, from any `parallel.tp_size` or "
        "`dp_size`) and, at TP 1 and DP 1, sglang (decodes with hybrid SWA memory, gpt-oss) "
        "and vllm (0.34 pull decodes; a `layer_major` pool); `check-config` shows its "
        "arithmetic (docs/models.md, 'The sliding-window pool').",
    )
    sliding_pages: int | None = Field(
        None,
        ge=1,
        description="Pages of the `windowed` sliding pool; unset: one quota (window - 1 plus "
        "two chunks, in pages) per `scheduler.max_running_requests`.",
    )

    @model_validator(mode="after")
    def _one_size(self) -> CacheConfig:
        if self.num_pages is None and self.memory_bytes is None and self.memory_fraction is None:
            raise ValueError("set one of num_pages, memory_bytes or memory_fraction")
        return self


class SchedulerConfig(Section):
    """Admission, chunking, deadlines and the overlap strategy."""

    chunk_size: int = Field(512, ge=1, description="Most prompt tokens of one request per step.")
    max_batch_tokens: int = Field(2048, ge=1, description="Token budget of one forward batch.")
    max_running_requests: int = Field(64, ge=1, description="Requests prefilling at once.")
    max_prompt_tokens: int = Field(8192, ge=1, description="Longest prompt accepted.")
    max_queued_requests: int = Field(
        4096, ge=1, description="Requests held (all states) before new ones are rejected."
    )
    bootstrap_timeout_s: float = Field(
        30.0, gt=0, description="Deadline for the decode peer's handshake."
    )
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="Deadline for pushing a request's KV once its prefill ends."
    )
    overlap: bool = Field(
        True, description="Run forward N while the CPU schedules N+1 (CUDA stream or thread)."
    )
    optimistic_prefill: bool = Field(
        True,
        description="Prefill a request before its decode claims the room; its pages are pushed "
        "when the claim comes (docs/architecture.md, optimistic prefill).",
    )
    optimistic_attempts: int = Field(
        2,
        ge=1,
        description="Prefills a request may start before its decode claims the room; after "
        "that it waits for the claim.",
    )
    optimistic_hold_s: float = Field(
        1.0,
        gt=0,
        description="How long a finished optimistic prefill keeps its pages for its decode's "
        "claim before it yields them to the prefix cache and is requeued.",
    )
    optimistic_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="The most optimistic prefills (requests no decode has claimed yet) may take "
        "of a forward's tokens, of max_running_requests and of the KV pages; they run only in "
        "forwards with no claimed work and evict no prefix-cache page a claimed request left.",
    )
    warmup_tokens: int = Field(
        256,
        ge=0,
        description="Tokens of the dummy prompt run once before the worker is ready, in chunks "
        "of at most chunk_size (first-use kernel compiles and allocations happen then, not on "
        "a request); 0: none.",
    )


class AdmissionConfig(Section):
    """Admission on the fronts, before a request enters the engine."""

    ttft_slo_s: float | None = Field(
        None,
        gt=0,
        description="Refuse a request whose predicted TTFT (docs/metrics.md) exceeds this "
        "many seconds: 429 on the HTTP API, `overloaded` on the ZMQ ingress. Unset: off.",
    )
