"""How each checkpoint tensor splits over tensor-parallel ranks: a table each family declares.

A ``Split`` names the dimension cut (None: replicated) and the unit it is cut in, so the
loader reads rank r's rows or columns straight from the safetensors file (never the whole
tensor) and the fused q/k/v and gate/up matrices are built from the slices::

    unit      count of units            rank r's units              rows per unit
    q_heads   num_heads                 parallel.q_head_range       head_dim
    kv_heads  num_kv_heads              parallel.kv_head_range      head_dim
    even      the dimension's length    parallel.even_range         1
    linear_qkv  a gated DeltaNet's [q | k | v] channel blocks, each cut evenly: rank r holds
              its key heads' q and k channels and its value heads' v channels (three runs)

Tensor names are HF's with every numeric path part (layer, expert) written ``*``. A family
lists every tensor it loads, replicated ones included: a name missing from its table is an
error, never a silent replication. Mixture-of-experts families add ``MOE_EXPERTS`` (each
expert split like a dense MLP, the router replicated) and DeepSeek's ``DEEPSEEK_MOE`` (plus
its score bias and shared experts); DeepSeek-V3 adds ``MLA``. The loader does not change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.hf_linear import LinearAttentionSpec
from prefill_worker.model.parallel import (
    TPGroup,
    check_shardable,
    even_range,
    kv_head_range,
    q_head_range,
)

Q_HEADS, KV_HEADS, EVEN = "q_heads", "kv_heads", "even"
LINEAR_QKV = "linear_qkv"  # three runs, not one: ``shard_slices``


@dataclass(frozen=True, slots=True)
class Split:
    dim: int | None  # the dimension cut; None: every rank holds the whole tensor
    unit: str = EVEN  # Q_HEADS | KV_HEADS | EVEN | LINEAR_QKV


REPLICATED = Split(None)
COLUMN = Split(0, EVEN)  # output rows: gate/up
ROW = Split(1, EVEN)  # input columns: down
Q_COLUMN, KV_COLUMN = Split(0, Q_HEADS), Split(0, KV_HEADS)  # q, k/v output rows (by head)
Q_ROW = Split(1, Q_HEADS)  # o: input columns, by query head

_LAYER = "model.layers.*."
DENSE: Mapping[str, Split] = {
    "model.embed_tokens.weight": REPLICATED,
    "model.norm.weight": REPLICATED,
    "lm_head.weight": REPLICATED,
    _LAYER + "input_layernorm.weight": REPLICATED,
    _LAYER + "post_attention_layernorm.weight": REPLICATED,
    _LAYER + "self_attn.q_proj.weight": Q_COLUMN,
    _LAYER + "self_attn.q_proj.bias": Q_COLUMN,
    _LAYER + "self_attn.k_proj.weight": KV_COLUMN,
    _LAYER + "self_attn.k_proj.bias": KV_COLUMN,
    _LAYER + "self_attn.v_proj.weight": KV_COLUMN,
    _LAYER + "self_attn.v_proj.bias": KV_COLUMN,
    _LAYER + "self_attn.o_proj.weight": Q_ROW,
    _LAYER + "self_attn.o_proj.bias": REPLICATED,  # added once, after the all-reduce
    _LAYER + "self_attn.q_norm.weight": REPLICATED,  # per head: [head_dim]
    _LAYER + "self_attn.k_norm.weight": REPLICATED,
    _LAYER + "mlp.gate_proj.weight": COLUMN,
    _LAYER + "mlp.gate_proj.bias": COLUMN,
    _LAYER + "mlp.up_proj.weight": COLUMN,
    _LAYER + "mlp.up_proj.bias": COLUMN,
    _LAYER + "mlp.down_proj.weight": ROW,
    _LAYER + "mlp.down_proj.bias": REPLICATED,  # added once, after the all-reduce
}
# A sparse layer's MLP: every expert split like a dense MLP (its gate/up rows, its down
# columns: the per-expert intermediate dimension), the router replicated (every rank routes
# every token the same way); DeepSeek's shared experts like a dense MLP.
MOE_EXPERTS: Mapping[str, Split] = {
    _LAYER + "mlp.gate.weight": REPLICATED,
    _LAYER + "mlp.experts.*.gate_proj.weight": COLUMN,
    _LAYER + "mlp.experts.*.up_proj.weight": COLUMN,
    _LAYER + "mlp.experts.*.down_proj.weight": ROW,
}
DEEPSEEK_MOE: Mapping[str, Split] = {
    **MOE_EXPERTS,
    _LAYER + "mlp.gate.e_score_correction_bias": REPLICATED,
    _LAYER + "mlp.shared_experts.gate_proj.weight": COLUMN,
    _LAYER + "mlp.shared_experts.up_proj.weight": COLUMN,
    _LAYER + "mlp.shared_experts.down_proj.weight": ROW,
}
# Multi-head latent attention: the query heads split (q_b / q_proj rows, kv_b's rows of each
# head's key and value, o's columns of each head's value); the low-rank projections, their
# norms, hence the latent each token writes into the pool, are replicated on every rank.
MLA: Mapping[str, Split] = {
    _LAYER + "self_attn.q_a_proj.weight": REPLICATED,
    _LAYER + "self_attn.q_a_layernorm.weight": REPLICATED,
    _LAYER + "self_attn.q_b_proj.weight": Q_COLUMN,
    _LAYER + "self_attn.q_proj.weight": Q_COLUMN,  # q_lora_rank None
    _LAYER + "self_attn.kv_a_proj_with_mqa.weight": REPLICATED,
    _LAYER + "self_attn.kv_a_layernorm.weight": REPLICATED,
    _LAYER + "self_attn.kv_b_proj.weight": Q_COLUMN,
    _LAYER + "self_attn.o_proj.weight": Q_ROW,
}
# DeepSeek-V3's MTP layer (``model.draft.mtp``) adds its input norms, the projection of
# [embedding | hidden] and the shared head's norm and head: all replicated.
NEXTN: Mapping[str, Split] = {
    _LAYER + name: REPLICATED
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
    )
}
# Qwen3-Next / Qwen3.5 (``model.hybrid_loader``): a gated DeltaNet layer splits by heads (its
# key heads' q/k channels, its value heads' v/z channels, gates, decays and state; the
# out projection's matching columns), so each rank's state slots hold its heads only.
# Qwen3-Next's fused in_proj_qkvz / in_proj_ba are grouped per key head: an even cut of the
# rows is a cut by key head. Full layers: q rows per head are [q | gate], cut by query head.
# The experts as MOE_EXPERTS; the one shared expert like a dense MLP, its gate replicated.
_LINEAR = _LAYER + "linear_attn."
GATED_DELTA_NET: Mapping[str, Split] = {
    _LINEAR + "in_proj_qkvz.weight": COLUMN,
    _LINEAR + "in_proj_ba.weight": COLUMN,
    _LINEAR + "in_proj_qkv.weight": Split(0, LINEAR_QKV),
    _LINEAR + "in_proj_z.weight": COLUMN,
    _LINEAR + "in_proj_b.weight": COLUMN,
    _LINEAR + "in_proj_a.weight": COLUMN,
    _LINEAR + "conv1d.weight": Split(0, LINEAR_QKV),
    _LINEAR + "A_log": COLUMN,
    _LINEAR + "dt_bias": COLUMN,
    _LINEAR + "norm.weight": REPLICATED,  # per head: [Dv]
    _LINEAR + "out_proj.weight": ROW,
}
SHARED_EXPERT: Mapping[str, Split] = {
    _LAYER + "mlp.shared_expert.gate_proj.weight": COLUMN,
    _LAYER + "mlp.shared_expert.up_proj.weight": COLUMN,
    _LAYER + "mlp.shared_expert.down_proj.weight": ROW,
    _LAYER + "mlp.shared_expert_gate.weight": REPLICATED,  # [1, hidden]: a scalar per token
}
_HYBRID = {**DENSE, **GATED_DELTA_NET, **MOE_EXPERTS, **SHARED_EXPERT}
# gpt-oss (``model.gpt_oss_loader``): the attention as DENSE, its sinks by query head (one per
# head); its experts, stored input-major and with gate/up interleaved per intermediate unit,
# cut along the intermediate dimension (an even cut of the interleaved 2I keeps pairs whole;
# MXFP4 blocks of the down projection: whole 32-value groups of it); the router replicated;
# each expert's down bias is added once over the group, by rank 0 (``gpt_oss.GptOssLM``).
_EXPERTS = _LAYER + "mlp.experts."
GPT_OSS: Mapping[str, Split] = {
    **DENSE,
    _LAYER + "self_attn.sinks": Q_COLUMN,
    _LAYER + "mlp.router.weight": REPLICATED,
    _LAYER + "mlp.router.bias": REPLICATED,
    _EXPERTS + "gate_up_proj": Split(2),  # [E, hidden, 2I]
    _EXPERTS + "gate_up_proj_bias": Split(1),  # [E, 2I]
    _EXPERTS + "down_proj": Split(1),  # [E, I, hidden]
    _EXPERTS + "down_proj_bias": REPLICATED,  # [E, hidden]
    _EXPERTS + "gate_up_proj_blocks": Split(1),  # [E, 2I, G, 16]
    _EXPERTS + "gate_up_proj_scales": Split(1),  # [E, 2I, G]
    _EXPERTS + "down_proj_blocks": Split(2),  # [E, hidden, I / 32, 16]
    _EXPERTS + "down_proj_scales": Split(2),  # [E, hidden, I / 32]
}
# Gemma 3 (``model.gemma3_loader``): DENSE plus its two feed-forward norms, replicated.
GEMMA3: Mapping[str, Split] = {
    **DENSE,
    _LAYER + "pre_feedforward_layernorm.weight": REPLICATED,
    _LAYER + "post_feedforward_layernorm.weight": REPLICATED,
}
_EMBED_AND_DENSE_MLP = {name: split for name, split in DENSE.items() if "self_attn." not in name}
_DEEPSEEK_V3 = {**_EMBED_AND_DENSE_MLP, **MLA, **DEEPSEEK_MOE, **NEXTN}
# DeepSeek-V3.2 / GLM-5 (``model.dsa_loader``): DeepSeek-V3's table plus the lightning
# indexer, replicated as SGLang and vLLM keep it (``ReplicatedLinear``): every rank computes
# the same index keys and picks the same top-k, so the index cache is the same on every rank,
# like the MLA latent it sits beside; only MLA's query heads split.
DSA_INDEXER: Mapping[str, Split] = {
    _LAYER + "self_attn.indexer." + name: REPLICATED
    for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
}
FAMILY_SPLITS: Mapping[str, Mapping[str, Split]] = {
    "llama": DENSE,
    "qwen2": DENSE,
    "qwen3": DENSE,
    "qwen3_moe": {**DENSE, **MOE_EXPERTS},
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v32": {**_DEEPSEEK_V3, **DSA_INDEXER},
    "glm_moe_dsa": {**_DEEPSEEK_V3, **DSA_INDEXER},
    "qwen3_next": _HYBRID,
    "qwen3_5": _HYBRID,
    "qwen3_5_moe": _HYBRID,
    "gpt_oss": GPT_OSS,
    "gemma3": GEMMA3,
}

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def routed_expert(name: str) -> int | None:
    """The routed expert a tensor belongs to (``...mlp.experts.{e}....``), else None: under
    expert parallelism such a tensor is read whole by its owner, by nobody else."""
    found = _ROUTED_EXPERT.search(name)
    return None if found is None else int(found.group(1))


@dataclass(frozen=True, slots=True)
class LocalDims:
    """The sizes one rank computes with."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int  # of the dense MLP


def local_dims(spec: ModelSpec, tp: TPGroup) -> LocalDims:
    if spec.moe is not None:
        even_range(spec.moe.intermediate_size, tp)  # each expert must split too
        even_range(spec.moe.shared_expert_size, tp)
    if spec.linear is not None:
        local_linear(spec.linear, tp)
    return LocalDims(
        num_heads=len(q_head_range(spec.num_heads, tp)),
        num_kv_heads=len(kv_head_range(spec.num_kv_heads, tp)),
        intermediate_size=len(even_range(spec.intermediate_size, tp)),
    )


def check_model_shardable(spec: ModelSpec, tp: TPGroup) -> None:
    """Raise ``ValueError`` (a configuration problem) if ``spec`` cannot run at ``tp``: its
    family has no split table, or its heads or widths
    (an expert's, a linear-attention layer's key heads) do not split."""
    if not tp.is_single and spec.family not in FAMILY_SPLITS:
        raise ValueError(
            f"{spec.architecture} runs at tensor parallel 1 only, not {tp.size} (family "
            f"{spec.family!r} has no tensor-parallel split)"
        )
    check_shardable(spec.num_heads, spec.num_kv_heads, spec.intermediate_size, tp)
    local_dims(spec, tp)


def local_linear(spec: LinearAttentionSpec, tp: TPGroup) -> LinearAttentionSpec:
    """A gated DeltaNet layer as rank ``tp.rank`` runs it: its key heads and the value heads
    that share them (``tp.size`` must divide the key heads)."""
    if spec.num_k_heads % tp.size:
        raise ValueError(
            f"{spec.num_k_heads} linear-attention key heads do not split over {tp.size} ranks"
        )
    return replace(
        spec, num_k_heads=spec.num_k_heads // tp.size, num_v_heads=spec.num_v_heads // tp.size
    )


def split_of(family: str, name: str) -> Split:
    """How ``family`` splits the tensor HF calls ``name``; ``KeyError`` if it does not say."""
    return split_in(FAMILY_SPLITS[family], name, family)


def split_in(table: Mapping[str, Split], name: str, owner: str = "table") -> Split:
    """``table``'s split of the tensor ``name``; ``KeyError`` if the table does not say."""
    pattern = _NUMBER.sub("*", name)
    if pattern not in table:
        raise KeyError(f"family {owner!r} declares no split for tensor {name}")
    return table[pattern]


def shard_slice(spec: ModelSpec, name: str, shape: tuple[int, ...], tp: TPGroup) -> slice:
    """The range of ``shape[split.dim]`` rank ``tp.rank`` holds (``slice(None)``: all)."""
    split = split_of(spec.family, name)
    if split.dim is None:
        return slice(None)
    if split.unit == LINEAR_QKV:
        raise ValueError(f"{name} is cut in three runs (shard_slices), not one")
    length = shape[split.dim]
    if split.unit == EVEN:
        owned = even_range(length, tp)
        return slice(owned.start, owned.stop)
    count = spec.num_heads if split.unit == Q_HEADS else spec.num_kv_heads
    rule = q_head_range if split.unit == Q_HEADS else kv_head_range
    owned = rule(count, tp)
    per_unit = length // count
    return slice(owned.start * per_unit, owned.stop * per_unit)


def shard_slices(
    spec: ModelSpec, name: str, shape: tuple[int, ...], tp: TPGroup
) -> tuple[slice, ...]:
    """The runs of ``shape[split.dim]`` rank ``tp.rank`` holds, in order: one, or for
    ``LINEAR_QKV`` its q, k and v channels (their concatenation is the rank's tensor)."""
    split = split_of(spec.family, name)
    if split.unit != LINEAR_QKV:
        return (shard_slice(spec, name, shape, tp),)
    assert spec.linear is not None and shape[0] == spec.linear.conv_dim
    key, value = spec.linear.key_dim, spec.linear.value_dim
    runs = []
    for offset, width in ((0, key), (key, key), (2 * key, value)):
        owned = even_range(width, tp)
        runs.append(slice(offset + owned.start, offset + owned.stop))
    return tuple(runs)


def local_shape(spec: ModelSpec, name: str, shape: tuple[int, ...], tp: TPGroup) -> tuple[int, ...]:
    """``shape`` as rank ``tp.rank`` holds it."""
    if tp.is_single:
        return shape
    split = split_of(spec.family, name)
    if split.dim is None:
        return shape
    width = sum(cut.stop - cut.start for cut in shard_slices(spec, name, shape, tp))
    return tuple(width if d == split.dim else n for d, n in enumerate(shape))
