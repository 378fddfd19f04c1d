"""A sliding-window model's KV-cache groups in the vLLM decode child (``vllm_child``), as a
vLLM 0.34 engine with its hybrid KV-cache manager (HMA, on by default) builds them: each
layer's spec (``SlidingWindowSpec`` for the config's ``sliding_attention`` layers, with its
``sliding_window``; ``FullAttentionSpec`` else), the groups from vLLM's own
``get_kv_cache_groups``, and a request's blocks per group clipped by vLLM's own scheduler half
(``get_exchange_clipped_blocks``: a sliding group keeps the blocks its window needs). Runs
only in the vLLM interop environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
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
        """None for a model without sliding layers (one group, as the child had)."""
        model = config.model_config
        types = list(getattr(model.hf_text_config, "layer_types", None) or ())
        if "sliding_attention" not in types:
            return None
        suffix = _ATTN_SUFFIX.get(model.architectures[0], "self_attn.attn")
        block_size = config.cache_config.block_size
        tp = config.parallel_config.tensor_parallel_size
        shape = {
            "block_size": block_size,
            "num_kv_heads": model.get_total_num_kv_heads() // tp,
            "head_size": model.get_head_size(),
            "dtype": model.dtype,
        }
        window = model.hf_text_config.sliding_window
        specs: dict[str, KVCacheSpec] = {
            f"model.layers.{i}.{suffix}": SlidingWindowSpec(**shape, sliding_window=window)
            if kind == "sliding_attention"
            else FullAttentionSpec(**shape)
            for i, kind in enumerate(types)
        }
        groups = get_kv_cache_groups(config, specs)
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        return cls(specs, groups, group_of, block_size)

    def attach(self, config: Any, kv_config: KVCacheConfig) -> None:
        """vLLM's scheduler half over the decode's cache config: what clips the blocks."""
        engine_id = config.kv_transfer_config.engine_id
        self._scheduler = NixlBaseConnectorScheduler(config, engine_id, kv_config)

    def allocate(self, num_tokens: int, free: list[int]) -> tuple[list[int], ...]:
        """A pull's blocks per group: every group's for ``num_tokens`` (as vLLM's manager
        allocates them), clipped as vLLM's scheduler clips them; the clipped ones go back."""
        count = -(-num_tokens // self.block_size)
        if count * len(self.kv_cache_groups) > len(free):
            raise ValueError(f"{count} blocks per group wanted; {len(free)} free")
        whole = tuple([free.pop() for _ in range(count)][::-1] for _ in self.kv_cache_groups)
        clipped = tuple(list(g) for g in self._scheduler.get_exchange_clipped_blocks(whole))
        kept = {block for group in clipped for block in group}
        free.extend(block for group in whole for block in group if block not in kept)
        return clipped
