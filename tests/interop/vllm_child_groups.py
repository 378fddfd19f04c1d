"""A hybrid model's KV-cache groups in the vLLM decode child (``vllm_child``), as a vLLM 0.34
engine with its hybrid KV-cache manager (HMA, on by default) builds them: each layer's spec
(``SlidingWindowSpec`` for the config's ``sliding_attention`` layers, with its
``sliding_window``; a GDN ``MambaSpec`` for ``linear_attention`` ones, its page padded to the
attention page as vLLM pads it; ``FullAttentionSpec`` else), the groups from vLLM's own
``get_kv_cache_groups``, and a request's blocks per group clipped by vLLM's own scheduler half
(``get_exchange_clipped_blocks``: a sliding group keeps the blocks its window needs, a mamba
group its state block). Runs only in the vLLM interop environment (a GDN model's also needs
``compressed-tensors`` and ``loguru`` there: vLLM imports them to inspect the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

# vLLM's attention layer names (its model files' prefixes), by architecture
_ATTN_SUFFIX = {"GptOssForCausalLM": "attn.attn"}


@dataclass
class SlidingGroups:
    specs: dict[str, KVCacheSpec]  # each layer's, in layer order
    kv_cache_groups: list[KVCacheGroupSpec]
    group_of: dict[str, int]
    block_size: int
    _scheduler: Any = field(default=None)

    @classmethod
    def of(cls, config: Any) -> SlidingGroups | None:
        """None for a model of one layer kind (one group, as the child had)."""
        model = config.model_config
        types = list(getattr(model.hf_text_config, "layer_types", None) or ())
        if not {"sliding_attention", "linear_attention"} & set(types):
            return None
        suffix = _ATTN_SUFFIX.get(model.architectures[0], "self_attn.attn")
        block_size = config.cache_config.block_size
        tp = config.parallel_config.tensor_parallel_size
        attn = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=model.get_total_num_kv_heads() // tp,
            head_size=model.get_head_size(),
            dtype=model.dtype,
        )
        specs: dict[str, KVCacheSpec] = {}
        for i, kind in enumerate(types):
            if kind == "sliding_attention":
                window = model.hf_text_config.sliding_window
                specs[f"model.layers.{i}.{suffix}"] = SlidingWindowSpec(
                    block_size=block_size,
                    num_kv_heads=attn.num_kv_heads,
                    head_size=attn.head_size,
                    dtype=attn.dtype,
                    sliding_window=window,
                )
            elif kind == "linear_attention":
                specs[f"model.layers.{i}.linear_attn"] = _gdn_spec(config, attn.page_size_bytes)
            else:
                specs[f"model.layers.{i}.{suffix}"] = attn
        groups = get_kv_cache_groups(config, specs)
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        return cls(specs, groups, group_of, block_size)

    def cache(self, name: str, num_blocks: int) -> torch.Tensor | None:
        """A mamba layer's cache as the connector registers it (bytes, ``[blocks, page]``);
        None for an attention layer."""
        spec = self.specs[name]
        if not isinstance(spec, MambaSpec):
            return None
        return torch.empty(num_blocks, spec.page_size_bytes, dtype=torch.uint8)

    def attach(self, config: Any, kv_config: KVCacheConfig) -> None:
        """vLLM's scheduler half over the decode's cache config: what clips the blocks."""
        engine_id = config.kv_transfer_config.engine_id
        self._scheduler = NixlBaseConnectorScheduler(config, engine_id, kv_config)

    def allocate(self, num_tokens: int, free: list[int]) -> tuple[list[int], ...]:
        """A pull's blocks per group: every group's for ``num_tokens`` (as vLLM's manager
        allocates them), clipped as vLLM's scheduler clips them; the clipped ones go back."""
        count = max(-(-num_tokens // self.block_size), 1)
        if count * len(self.kv_cache_groups) > len(free):
            raise ValueError(f"{count} blocks per group wanted; {len(free)} free")
        whole = tuple([free.pop() for _ in range(count)][::-1] for _ in self.kv_cache_groups)
        clipped = tuple(list(g) for g in self._scheduler.get_exchange_clipped_blocks(whole))
        kept = {block for group in clipped for block in group}
        free.extend(block for group in whole for block in group if block not in kept)
        return clipped


def _gdn_spec(config: Any, attn_page_bytes: int) -> MambaSpec:
    """A GDN layer's state as vLLM's Qwen3-Next layer declares it, its page padded to the
    attention page (vLLM's ``mamba_page_size_padded``)."""
    model, text = config.model_config, config.model_config.hf_text_config
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        config.parallel_config.tensor_parallel_size,
        text.linear_num_key_heads,
        text.linear_num_value_heads,
        text.linear_key_head_dim,
        text.linear_value_head_dim,
        text.linear_conv_kernel_dim,
    )
    cache = config.cache_config  # the decode's --mamba-cache-dtype, --mamba-ssm-cache-dtype
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        model.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
    )
    return MambaSpec(
        block_size=config.cache_config.block_size,
        shapes=shapes,
        dtypes=dtypes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        page_size_padded=attn_page_bytes,
    )
