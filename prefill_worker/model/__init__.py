"""The model side of the worker: checkpoint, KV pool, runner; ``build`` composes them.

The daemon calls ``build(...)`` once at start-up and gets the runner (the scheduler's
``ModelRunner``), the KV pool (whose ``regions(...)`` the transfer side registers) and a
``ModelInfo`` with the limits the scheduler and ingress check requests against.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, VLLM_BLOCKS, KVLayout
from prefill_worker.kv.state_layout import StateComponent, StateRegions
from prefill_worker.model.attention import (
    AttentionBackend,
    create_backend,
    create_mla_backend,
    resolve_backend_name,
    resolve_mla_backend_name,
)
from prefill_worker.model.attention.sdpa_dsa import DSASdpaBackend
from prefill_worker.model.attention.sinks import SinkWindowBackend
from prefill_worker.model.deepseek import DeepseekV3LM, MLAModelWeights
from prefill_worker.model.draft.build import num_draft_layers, with_draft
from prefill_worker.model.dsa import DeepseekV32LM, DSAModelWeights
from prefill_worker.model.gdn_rule import choose_delta_rule
from prefill_worker.model.gemma3 import Gemma3LM, Gemma3ModelWeights
from prefill_worker.model.gpt_oss import GptOssLM, GptOssModelWeights
from prefill_worker.model.hf_config import CheckpointError, ModelSpec, read_spec
from prefill_worker.model.index_cache import IndexCache
from prefill_worker.model.kv_cache import (
    DTYPE_NAMES,
    TORCH_DTYPES,
    KVCache,
    SlidingSpace,
    pool_num_pages,
)
from prefill_worker.model.llama import CausalLM, ModelWeights
from prefill_worker.model.loader import LoadProgress, SlidingWeights, load_checkpoint
from prefill_worker.model.moe import ExpertsBackend, create_moe_backend, resolve_moe_backend_name
from prefill_worker.model.moe.ep import EPGroup, create_ep_experts, resolve_exchange_name
from prefill_worker.model.moe.flashinfer_mxfp4 import mxfp4_experts_line
from prefill_worker.model.moe.placement import check_expert_parallel
from prefill_worker.model.parallel import SINGLE, TPGroup
from prefill_worker.model.quant.backends import (
    Fp8WeightBackend,
    create_fp8_backend,
    select_fp8_backend,
)
from prefill_worker.model.quant.kv import FP8_E4M3, check_kv_backend, kv_dtype_name
from prefill_worker.model.quant.kv_scales import load_kv_scales
from prefill_worker.model.qwen3_next import HybridModelWeights, Qwen3NextLM
from prefill_worker.model.runner import Runner
from prefill_worker.model.sharding import check_model_shardable, local_linear
from prefill_worker.model.state_cache import StateCache
from prefill_worker.model.state_gather import StateGather

__all__ = [
    "CheckpointError",
    "KVCache",
    "LoadProgress",
    "ModelInfo",
    "Runner",
    "TPGroup",
    "build",
    "create_model",
    "resolve_device",
]

log = logging.getLogger(__name__)

DEFAULT_STATE_SLOTS = 8  # a hybrid model's per-request state slots when none are asked


@dataclass(frozen=True, slots=True)
class ModelInfo:
    architecture: str
    vocab_size: int
    max_position: int  # longest prompt the model accepts
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu" | "cuda:N"
    attention_backend: str  # resolved: "sdpa" | "flashinfer" | "sinks" (gpt-oss's)
    moe_backend: str | None  # resolved: "grouped" | "naive" | "flashinfer"; None: a dense model
    eos_token_ids: tuple[int, ...]
    state: StateComponent | None = None  # a hybrid's state pool, a DSA model's index keys
    state_regions: StateRegions | None = None  # where that pool's slots (pages) live
    sliding_window: int | None = None  # a sliding-window model's window (gpt-oss, Gemma 3)
    sliding_layers: tuple[int, ...] = ()  # which of its layers slide
    kernel_paths: tuple[str, ...] = ()  # "gdn=flashinfer (SM90)", "gdn=torch (why)", ...


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else as torch reads it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, spec: ModelSpec) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (fp32 when it names none)."""
    if name == "auto":
        name = spec.torch_dtype if spec.torch_dtype in TORCH_DTYPES else "float32"
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (supported: {', '.join(TORCH_DTYPES)})")
    return TORCH_DTYPES[name]


def build(
    model_path: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    attention_backend: str = "auto",
    page_size: int = 16,
    num_pages: int | None = None,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    num_threads: int | None = None,
    on_progress: LoadProgress | None = None,
    pool_layout: str = LAYER_MAJOR,
    tp: TPGroup = SINGLE,
    moe_backend: str = "auto",
    num_state_slots: int = DEFAULT_STATE_SLOTS,
    draft: str = "none",
    draft_topk: int = 1,
    kv_dtype: str = "auto",
    ep_size: int = 1,
    expert_placement: Sequence[int] = (),
    ep_exchange: str = "torch",
    draft_path: str | Path | None = None,
    fp8_backend: Fp8WeightBackend | None = None,
    dp: TPGroup = SINGLE,
    sliding_pages: int | None = None,
) -> tuple[Runner, KVCache, ModelInfo]:
    """Load the checkpoint, allocate the KV pool (``pool_layout``: ``kv.layout``'s kinds),
    pick the attention backend (and, for a MoE family, the experts' backend ``moe_backend``,
    ``model.moe``'s registry). ``on_progress(bytes_read, bytes_total)`` follows the weights
    as they load. Under tensor parallelism (``tp``, a rank of its group) the rank
    loads its slices and its pool holds its KV heads only (``parallel.kv_head_range``);
    ``ModelInfo`` describes the whole model. A hybrid model (linear attention) also gets a
    state pool of ``num_state_slots`` per-request slots, and its KV pool holds its
    full-attention layers only (under TP, the rank's heads of both; the leader also keeps the
    finished prompts' slots whole, ``model.state_gather``, and describes those). A ``draft``
    (``model.draft``: ``mtp``; ``eagle``, ``eagle3`` with its checkpoint at ``draft_path``)
    runs after the target with its own one-layer pool of as many pages (within the budget),
    its first proposal top-``draft_topk``. ``kv_dtype`` ``fp8_e4m3`` makes the KV pool FP8
    (``model.quant.kv``). ``ep_size`` (1 or ``tp.size``) places the routed experts whole over
    the group's ranks (``expert_placement``: one rank per expert, else contiguous) and moves
    tokens to them through the ``ep_exchange`` (``model.moe.ep``). ``dp``: an attention-DP
    rank's place among the DP ranks and their process group; ``ep_size`` ``dp.size`` places
    the experts over the DP ranks instead, each exchanging its own tokens (every rank's
    forwards in lockstep, ``dp.lockstep``; ``Runner.run_idle`` when it has none). FP8 weights
    become what ``fp8_backend`` makes of them (None: the registry's choice for the device,
    ``quant.backends.select_fp8_backend``: kept for the block-scaled GEMM on a Hopper GPU,
    else dequantized at load).

    ``sliding_pages`` (a sliding-window model): its sliding layers get their own page space
    of that many pages (``cache.sliding_pool: windowed``, ``kv_cache.SlidingSpace``), taken
    from the budget first; None: every layer in the one pool.

    Raises ``CheckpointError`` for an unusable checkpoint and ``ValueError`` for a bad
    setting (both are configuration problems: exit 78)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    dev = resolve_device(device)
    backend_name = resolve_backend_name(attention_backend, dev)
    declared = read_spec(model_path)
    torch_dtype = resolve_dtype(dtype, declared)
    fp8 = fp8_backend or create_fp8_backend(select_fp8_backend(declared, dev))
    kept = fp8.keeps_blocks and declared.quant is not None  # FP8 weights kept as shipped
    experts_name = resolve_moe_backend_name(moe_backend, dev, torch_dtype, kept)  # before loading
    check_model_shardable(declared, tp)
    placement = check_expert_parallel(declared, tp.size, ep_size, expert_placement, dp.size)
    if placement is not None:
        resolve_exchange_name(ep_exchange, dev)
        if draft != "none":
            raise ValueError(f"draft {draft!r} does not run at parallel.ep_size {ep_size}")
    if declared.mla is not None:
        pool_layout = _mla_pool(pool_layout)
        backend_name = resolve_mla_backend_name(backend_name, declared.mla, torch_dtype)
    experts_paths: tuple[str, ...] = ()  # gpt-oss: its MXFP4 experts kept or not, and why
    if declared.sliding is not None and declared.family == "gpt_oss":
        experts_paths = (
            mxfp4_experts_line(moe_backend, dev, torch_dtype, declared.sliding, tp.size),
        )
    keep = experts_paths[0].startswith("experts=flashinfer_mxfp4") if experts_paths else False
    ranks = dp if dp.size > 1 else tp  # the ranks the experts are placed over
    spec, weights = load_checkpoint(
        model_path, torch_dtype, dev, on_progress, tp, placement, fp8, ranks.rank, keep
    )
    if spec.quant is not None:
        log.info("FP8 weights: %s (model.quant.backends)", fp8.name)
    experts: ExpertsBackend = create_moe_backend(experts_name, dev, torch_dtype)
    if placement is not None:
        ep = EPGroup(ranks.rank, placement, ranks.group, local_tokens=dp.size > 1)
        experts = create_ep_experts(experts, ep_exchange, ep, dev)
        log.info("expert parallel %d: rank %d holds experts %s", ep_size, ranks.rank,
                 list(placement.local_experts(ranks.rank)))  # fmt: skip
    state = gather = None
    if spec.linear is not None:
        state = StateCache(local_linear(spec.linear, tp), num_state_slots, torch_dtype, dev)
        log.info("state pool: %d slots, %d bytes", num_state_slots, state.num_bytes)
        if not tp.is_single:  # the transfer sends whole slots: the leader gathers them
            gather = StateGather(spec.linear, state, tp)
            if gather.whole is not None:
                log.info("whole state slots (sent): %d bytes", gather.whole.num_bytes)
    index_cache = None  # a DSA model's index keys, paged beside the MLA pool
    if spec.indexer is not None:
        index_cache = IndexCache(spec.indexer, page_size, torch_dtype, dev)
    model, attention = create_model(
        spec, weights, tp, experts, backend_name, state, index_cache, gather, experts_paths
    )
    if isinstance(attention, SinkWindowBackend | DSASdpaBackend):
        backend_name = attention.name
    dtype_name = kv_dtype_name(kv_dtype, DTYPE_NAMES[torch_dtype])
    check_kv_backend(dtype_name, backend_name)
    if pool_layout == VLLM_BLOCKS and backend_name != "sdpa":  # strided K/V views: sdpa's
        raise ValueError(  # gather reads any strides; flashinfer's paged kernels do not
            f"pool layout {VLLM_BLOCKS} is read by the sdpa attention backend only "
            f"(resolved {backend_name!r}): set model.attention_backend sdpa"
        )
    one_page = KVLayout(
        len(spec.linear.full_layers) if spec.linear is not None else spec.num_layers,
        model.local.num_kv_heads,
        spec.head_dim,
        dtype_name,
        page_size,
        1,
        pool_layout,
    )
    space = _sliding_space(spec, sliding_pages)
    num_pooled = one_page.num_layers - (len(space.layers) if space is not None else 0)
    with_draft_layers = num_pooled + num_draft_layers(draft)
    budgeted = dataclasses.replace(one_page, num_layers=with_draft_layers)
    index_bytes = 0 if index_cache is None else index_cache.bytes_per_page
    reserved = 0 if space is None else 2 * len(space.layers) * space.num_pages * one_page.page_bytes
    pages = pool_num_pages(
        budgeted, dev, num_pages, memory_bytes, memory_fraction, index_bytes, reserved
    )
    if index_cache is not None:
        index_cache.allocate(pages)
        log.info("index cache (DSA): %d bytes beside the pool", index_cache.num_bytes)
    scales = load_kv_scales(Path(model_path), spec) if dtype_name == FP8_E4M3 else None
    kv_scales = () if scales is None else scales.flat()  # checkpoint K/V scales, FP8 only
    kv_layout = dataclasses.replace(one_page, num_pages=pages, kv_scales=kv_scales)
    kv_cache = KVCache(kv_layout, dev, space)
    log.info(
        "KV pool (%s): %d pages of %d tokens%s, %d bytes",
        pool_layout,
        pages,
        page_size,
        "" if space is None else f", the sliding layers' {space.num_pages} pages beside",
        kv_cache.num_bytes,
    )
    runner = Runner(model, kv_cache, attention)
    runner = with_draft(model_path, runner, draft, draft_topk, draft_path, fp8)
    moe_name = experts_name if spec.moe is not None else None
    info = _info(spec, one_page.dtype, kv_cache.device_name, backend_name, moe_name)
    whole = gather.whole if gather is not None else state  # the leader's whole slots
    beside = whole if whole is not None else index_cache  # what a decode needs beside the KV
    if beside is not None:
        regions = beside.regions(kv_cache.device_name)
        info = dataclasses.replace(info, state=regions.component, state_regions=regions)
    elif gather is not None:  # a follower: the whole slots described, none held or sent here
        info = dataclasses.replace(info, state=gather.component)
    if spec.sliding is not None:
        sliding = spec.sliding
        info = dataclasses.replace(
            info, sliding_window=sliding.window, sliding_layers=sliding.sliding_layers
        )
    return runner, kv_cache, dataclasses.replace(info, kernel_paths=kernel_paths(model))


def _sliding_space(spec: ModelSpec, sliding_pages: int | None) -> SlidingSpace | None:
    """The sliding layers' own page space of ``sliding_pages`` pages; None without one."""
    if sliding_pages is None:
        return None
    if spec.sliding is None:
        raise ValueError("cache.sliding_pool windowed: the model has no sliding-window layers")
    if sliding_pages < 1:
        raise ValueError(f"cache.sliding_pages {sliding_pages}: a sliding pool needs a page")
    return SlidingSpace(spec.sliding.sliding_layers, sliding_pages)


def kernel_paths(model: object) -> tuple[str, ...]:
    """Which kernel each of the model's optional CUDA paths runs and why (``ModelInfo``'s
    ``kernel_paths``): the families that have one (Qwen3-Next's delta rule, gpt-oss's MXFP4
    experts) say so in their ``kernel_paths``; the others have none."""
    return tuple(getattr(model, "kernel_paths", ()))


def create_model(
    spec: ModelSpec,
    weights: ModelWeights | MLAModelWeights | HybridModelWeights | SlidingWeights,
    tp: TPGroup,
    experts: ExpertsBackend,
    attention_backend: str,
    state: StateCache | None = None,
    index_cache: IndexCache | None = None,
    gather: StateGather | None = None,
    experts_paths: tuple[str, ...] = (),
) -> tuple[CausalLM | DeepseekV3LM | Qwen3NextLM | GptOssLM | Gemma3LM, AttentionBackend]:
    """The family's decoder over loaded ``weights`` and the attention backend it runs with
    (an MLA family: ``MLA_BACKENDS``' of that name, where its kernels apply; a hybrid
    family: over the state pool ``state``; gpt-oss, Gemma 3: ``attention.sinks``' torch backend,
    whatever ``attention_backend`` names, the others having no sinks or windows; a DSA family:
    ``attention.sdpa_dsa``'s, writing its index keys into ``index_cache``; gpt-oss's
    ``experts_paths``: ``moe.flashinfer_mxfp4.mxfp4_experts_line``'s, for
    ``ModelInfo.kernel_paths``)."""
    device = weights.embed.device
    if isinstance(weights, DSAModelWeights):
        assert index_cache is not None, "a DSA model needs its index cache"
        return DeepseekV32LM(spec, weights, index_cache, tp, experts), DSASdpaBackend(device)
    if isinstance(weights, GptOssModelWeights):
        return GptOssLM(spec, weights, tp, experts_paths), SinkWindowBackend(device)
    if isinstance(weights, Gemma3ModelWeights):
        return Gemma3LM(spec, weights, tp), SinkWindowBackend(device)
    if isinstance(weights, HybridModelWeights):
        assert state is not None, "a hybrid model needs its state pool"
        assert spec.linear is not None  # hybrid weights come from a hybrid spec
        rule, line = choose_delta_rule(attention_backend, device, weights.embed.dtype, spec.linear)
        model = Qwen3NextLM(spec, weights, state, tp, experts, gather, rule, (line,))
        return model, create_backend(attention_backend, device)
    if isinstance(weights, MLAModelWeights):
        assert spec.mla is not None  # MLA weights come from an MLA spec
        attention = create_mla_backend(attention_backend, device, spec.mla, weights.embed.dtype)
        return DeepseekV3LM(spec, weights, tp, experts), attention
    return CausalLM(spec, weights, tp, experts), create_backend(attention_backend, device)


def _mla_pool(pool_layout: str) -> str:
    """An MLA model's pool is always the ``mla`` kind; the K/V layouts do not apply."""
    if pool_layout not in (LAYER_MAJOR, MLA):
        raise ValueError(f"pool layout {pool_layout!r} does not apply to an MLA model")
    return MLA


def _info(spec: ModelSpec, dtype: str, device: str, backend: str, experts: str | None) -> ModelInfo:
    return ModelInfo(
        architecture=spec.architecture,
        vocab_size=spec.vocab_size,
        max_position=spec.max_position,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        dtype=dtype,
        device=device,
        attention_backend=backend,
        moe_backend=experts,
        eos_token_ids=spec.eos_token_ids,
    )
