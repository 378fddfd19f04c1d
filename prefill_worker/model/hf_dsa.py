"""The sparse-attention (DSA) part of a DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) or GLM-5
(``GlmMoeDsaForCausalLM``) config: MLA plus a lightning indexer per layer. Read by
``hf_config.spec_from_dict`` for those families only; torch-free.

Each indexed layer scores every earlier key for each query with its own small projections
(``index_n_heads`` heads of ``index_head_dim``, one shared key per token, ``model.dsa``
has the arithmetic) and the layer's MLA attends over the ``index_topk`` best keys only. The
per-token index key is kept beside the MLA pool (``model.index_cache``). GLM-5 may let a
layer reuse the previous indexed layer's choice (``indexer_types``: ``"shared"``); such a
layer has no indexer and no index key. DeepSeek-V3.2 rotates the index key's rope part in
half-split pairs, GLM-5 in interleaved ones (transformers' two indexers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
FULL, SHARED = "full", "shared"


@dataclass(frozen=True, slots=True)
class IndexerSpec:
    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim; its first qk_rope_head_dim dims are rotated
    topk: int  # keys each query attends to (all of them while fewer are visible)
    rope_interleave: bool  # GLM-5: interleaved pairs; DeepSeek-V3.2: half-split
    layer_types: tuple[str, ...]  # per layer: FULL (own indexer) | SHARED (the previous one's)

    @property
    def indexed_layers(self) -> tuple[int, ...]:
        """The layers that run an indexer, hence keep an index key per token."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL)


def indexer_spec(raw: Mapping[str, Any], family: str) -> IndexerSpec:
    """The indexer of a DSA family's config; ``ValueError`` names a bad field."""
    num_layers = int(raw["num_hidden_layers"])
    if not raw.get("q_lora_rank"):
        raise ValueError("a DSA model's indexer reads the low-rank q: q_lora_rank is missing")
    kinds = tuple(str(k) for k in _layer_types(raw, family, num_layers))
    if len(kinds) != num_layers or set(kinds) - {FULL, SHARED}:
        raise ValueError(f"indexer_types {list(kinds)}: one of full|shared per layer")
    if kinds and kinds[0] != FULL:
        raise ValueError("indexer_types: the first layer must run its own indexer (full)")
    spec = IndexerSpec(
        num_heads=int(raw.get("index_n_heads") or 64),
        head_dim=int(raw.get("index_head_dim") or 128),
        topk=int(raw.get("index_topk") or 2048),
        rope_interleave=family == "glm_moe_dsa",
        layer_types=kinds,
    )
    if spec.head_dim < int(raw["qk_rope_head_dim"]) or spec.topk < 1 or spec.num_heads < 1:
        raise ValueError(
            f"indexer: {spec.num_heads} heads of {spec.head_dim} (at least qk_rope_head_dim), "
            f"top-{spec.topk}"
        )
    return spec


def _layer_types(raw: Mapping[str, Any], family: str, num_layers: int) -> list[str]:
    """transformers' rule: an explicit ``indexer_types``, else GLM's ``index_topk_pattern``
    (``"FSS..."``), else its ``index_topk_freq`` / ``index_skip_topk_offset`` schedule;
    DeepSeek-V3.2 indexes every layer."""
    if family != "glm_moe_dsa":
        return [FULL] * num_layers
    if raw.get("indexer_types") is not None:
        return list(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": FULL, "S": SHARED}
        return [letters[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(int(raw.get("index_topk_freq") or 1), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers)]
