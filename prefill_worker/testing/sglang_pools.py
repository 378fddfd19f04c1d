"""SGLang's decode-side KV pools as its decode server builds them, on the CPU, for the
interop harness (``sglang_child``): a plain MHA or MLA pool, gpt-oss's hybrid SWA pool, and a
hybrid linear-attention model's (Qwen3.5, Qwen3-Next) full-layer pool with its ``MambaPool``.
Imported only in the interop environment."""

from __future__ import annotations

import os
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}  # fp8: SGLang stores its bytes as uint8


def named(pool: Any, is_mla: bool, prefix: str) -> list[tuple[str, Any]]:
    """("k0", K of layer 0), ... ("v0", ...) (the latents as k of an MLA pool); a draft
    pool's as ("dk0", ...)."""
    if is_mla:
        return [(f"{prefix}k{i}", buf) for i, buf in enumerate(pool.kv_buffer)]
    k = [(f"{prefix}k{i}", buf) for i, buf in enumerate(pool.k_buffer)]
    return k + [(f"{prefix}v{i}", buf) for i, buf in enumerate(pool.v_buffer)]


def kv_pool(spec: dict[str, Any], is_mla: bool) -> Any:
    """SGLang's KV pool for the spec; an MLA latent of ``head_dim`` values (split into
    ``kv_lora_rank`` and ``qk_rope_head_dim`` as any model would: only the sum shapes it)."""
    dtype = DTYPES[spec["dtype"]]
    page_size, num_layers, head_dim = spec["page_size"], spec["num_layers"], spec["head_dim"]
    num_tokens = (spec["num_pages"] - 1) * page_size  # SGLang adds the padding page
    if is_mla:
        rope = head_dim // 3
        return MLATokenToKVPool(
            num_tokens, page_size, dtype, head_dim - rope, rope, num_layers, "cpu", False
        )
    heads = spec["num_kv_heads"]
    return MHATokenToKVPool(num_tokens, page_size, dtype, heads, head_dim, num_layers, "cpu", False)


def swa_pool(spec: dict[str, Any]) -> Any:
    """SGLang's hybrid SWA pool as its decode builds one for gpt-oss (``kv_cache_configurator``,
    ``_build_hybrid_swa_kv_pool``): the full layers in ``num_pages`` pages, the sliding ones in
    ``swa_pages``, each an ``MHATokenToKVPool``."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    page_size, num_layers = spec["page_size"], spec["num_layers"]
    sliding = list(spec["sliding_layers"])
    return SWAKVPool(
        size=(spec["num_pages"] - 1) * page_size,
        size_swa=(spec["swa_pages"] - 1) * page_size,
        page_size=page_size,
        dtype=DTYPES[spec["dtype"]],
        head_num=spec["num_kv_heads"],
        head_dim=spec["head_dim"],
        swa_attention_layer_ids=sliding,
        full_attention_layer_ids=[i for i in range(num_layers) if i not in sliding],
        device="cpu",
        enable_kv_cache_copy=False,
        token_to_kv_pool_class=MHATokenToKVPool,
        enable_memory_saver=False,
    )


def mamba_pool(spec: dict[str, Any]) -> Any:
    """SGLang's pool for a hybrid linear-attention model (Qwen3.5, Qwen3-Next) as its decode
    builds one (``kv_cache_configurator``: ``HybridLinearKVPool`` over the full layers, with
    the ``MambaPool`` its ``HybridMambaDecodeReqToTokenPool`` makes of the config's
    ``mamba2_cache_params``, here of the spec's shapes, for this process's attention-TP
    rank). The conv dtype is what the decode's ``SGLANG_MAMBA_CONV_DTYPE`` (``conv_dtype``)
    makes it, the temporal float32."""
    from sglang.srt.configs.mamba_utils import (
        Mamba2CacheParams,
        Mamba2StateShape,
        mamba2_state_dtype,
    )
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    k_heads, v_heads, k_dim, v_dim, kernel = spec["linear_shape"]
    linear = list(spec["linear_layers"])
    from sglang.srt.runtime_context import linear_attn_tp_size

    shape = Mamba2StateShape.create(
        tp_world_size=linear_attn_tp_size(),  # as qwen3_next's mamba2_cache_params
        intermediate_size=v_dim * v_heads,
        n_groups=k_heads,
        num_heads=v_heads,
        head_dim=v_dim,
        state_size=k_dim,
        conv_kernel=kernel,
        conv_shard_groups=[k_heads * k_dim, k_heads * k_dim, v_heads * v_dim],
    )
    os.environ["SGLANG_MAMBA_CONV_DTYPE"] = spec.get("conv_dtype", "bfloat16")
    params = Mamba2CacheParams(shape=shape, layers=linear, dtype=mamba2_state_dtype(None))
    slots = int(spec["mamba_slots"]) - 1  # the pool adds one
    mamba = MambaPool(
        size=slots,
        spec_state_size=slots,
        cache_params=params,
        mamba_layer_ids=linear,
        device="cpu",
        enable_memory_saver=False,
        speculative_num_draft_tokens=None,
    )
    page_size, num_layers = spec["page_size"], spec["num_layers"]
    return HybridLinearKVPool(
        size=(spec["num_pages"] - 1) * page_size,
        dtype=DTYPES[spec["dtype"]],
        page_size=page_size,
        head_num=spec["num_kv_heads"],
        head_dim=spec["head_dim"],
        full_attention_layer_ids=[i for i in range(num_layers) if i not in linear],
        device="cpu",
        mamba_pool=mamba,
        enable_memory_saver=False,
    )


def dsa_pool(spec: dict[str, Any]) -> Any:
    """SGLang's DSA pool (DeepSeek-V3.2): an MLA latent of ``head_dim`` values and an index
    buffer per layer, in ``num_pages`` pages of 64 tokens (the page size it requires)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    page_size, head_dim, rope = spec["page_size"], spec["head_dim"], spec["head_dim"] // 5
    return DSATokenToKVPool(
        size=(spec["num_pages"] - 1) * page_size,
        page_size=page_size,
        kv_lora_rank=head_dim - rope,
        dtype=DTYPES[spec["dtype"]],
        qk_rope_head_dim=rope,
        layer_num=spec["num_layers"],
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=head_dim,
    )
