"""The one adapter that reads a Hugging Face ``config.json`` into a typed ``ModelSpec``.

HF configs are fuzzy: field names moved between versions (``rope_theta`` and ``rope_scaling``
became ``rope_parameters``; ``torch_dtype`` became ``dtype``), some are optional (``head_dim``),
some mean different things per family (Qwen2 always has q/k/v bias). All of that is decided
here, once, so the model code reads plain typed fields. Torch-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefill_worker.model.hf_dsa import DSA_FAMILIES, IndexerSpec, indexer_spec
from prefill_worker.model.hf_linear import HYBRID_FAMILIES, LinearAttentionSpec, linear_spec
from prefill_worker.model.hf_sliding import (
    MXFP4,
    SLIDING_FAMILIES,
    SlidingSpec,
    global_rope_fields,
    quant_method,
    sliding_spec,
)
from prefill_worker.model.quant.spec import QuantSpec, quant_spec

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
MLA_FAMILIES = ("deepseek_v3", *DSA_FAMILIES)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class CheckpointError(Exception):
    """The checkpoint cannot be served; the message names the file, field or tensor."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn (DeepSeek-V3): the ramp's rotation bounds and the attention-scale factors
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: absent
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: derived from factor and the mscales
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3). Each token's KV is one latent row of
    ``kv_lora_rank`` (normalised) plus a shared roped key part of ``qk_rope_head_dim``; the
    heads' keys (``qk_nope_head_dim``) and values (``v_head_dim``) are decompressed from it.
    ``rope_interleave``: the rotary pairs are (x0, x1), (x2, x3)... (DeepSeek's default),
    else the half-split pairs of Llama. ``softmax_scale`` includes YaRN's ``mscale_all_dim``."""

    q_lora_rank: int | None  # None: one q_proj, no low-rank q
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One pool row: the latent, then the roped key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A mixture-of-experts MLP: which layers are sparse and how tokens are routed.

    ``scoring`` is ``softmax`` (Qwen3-MoE: softmax over all experts, top-k) or ``sigmoid``
    (DeepSeek-V3: sigmoid scores, the top-k chosen on ``score + e_score_correction_bias``
    within the ``topk_group`` best of ``n_group`` expert groups, weighted by the plain
    score). ``norm_topk_prob`` renormalises the k weights to sum 1; the weights are then
    multiplied by ``routed_scaling_factor``. ``num_shared_experts`` (DeepSeek) adds a dense
    MLP of ``num_shared_experts * intermediate_size`` beside the routed ones."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    sparse_layers: frozenset[int]  # the others run the dense MLP of ModelSpec
    norm_topk_prob: bool
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    has_score_bias: bool = False  # e_score_correction_bias (sigmoid scoring)
    shared_expert_size: int = 0  # Qwen3-Next: one shared expert, gated by sigmoid(h @ w)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the model code needs from config.json, already resolved per family."""

    architecture: str  # a key of ARCHITECTURES
    family: str  # a value of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # MLA: 1 (the latent)
    head_dim: int  # MLA: the pool row, kv_lora_rank + qk_rope_head_dim
    rms_norm_eps: float
    rope: RopeSpec
    max_position: int  # longest prompt the weights support (capped by a sliding window)
    tie_word_embeddings: bool
    has_qkv_bias: bool
    has_o_bias: bool
    has_mlp_bias: bool
    has_qk_norm: bool
    torch_dtype: str | None  # the checkpoint's own dtype name, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    moe: MoESpec | None = None  # None: every layer is dense
    mla: MLASpec | None = None  # None: grouped-query attention over K/V heads
    linear: LinearAttentionSpec | None = None  # a hybrid: its linear layers (hf_linear)
    sliding: SlidingSpec | None = None  # gpt-oss: its sliding layers, sinks, experts
    num_nextn_layers: int = 0  # DeepSeek-V3's MTP layers, stored after the last decoder layer
    quant: QuantSpec | None = None  # FP8 weights (model.quant.spec); None: unquantized
    indexer: IndexerSpec | None = None  # DeepSeek-V3.2 / GLM-5's sparse attention (hf_dsa)

    def outer_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors around the layers every family's checkpoint holds: the embedding, the
        final norm and, when not tied to the embedding, the LM head."""
        shapes = {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden_size),
            "model.norm.weight": (self.hidden_size,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return shapes

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers


def read_spec(model_dir: str | Path) -> ModelSpec:
    """Parse ``model_dir/config.json``; raise ``CheckpointError`` naming what is wrong."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    try:
        return spec_from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def spec_from_dict(raw: Mapping[str, Any]) -> ModelSpec:
    arch = _architecture(raw)
    family = ARCHITECTURES[arch]
    num_heads = int(_need(raw, "num_attention_heads"))
    hidden = int(_need(raw, "hidden_size"))
    head_dim = raw.get("head_dim") or hidden // num_heads
    has_bias = bool(raw.get("attention_bias", False))
    mla = mla_spec(raw) if family in MLA_FAMILIES else None
    if mla is not None and has_bias:
        raise ValueError("attention_bias is not supported with multi-head latent attention")
    rope = _rope(global_rope_fields(raw, family))
    yarn_proven = mla is not None or family in SLIDING_FAMILIES  # against transformers
    if rope.rope_type == "yarn" and not yarn_proven:
        raise ValueError(
            f"rope type 'yarn' is not supported for {arch} (only DeepSeek-V3, gpt-oss)"
        )
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=int(_need(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_need(raw, _dense_width_key(family))),
        num_layers=int(_need(raw, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=1 if mla else int(raw.get("num_key_value_heads") or num_heads),
        head_dim=mla.latent_dim if mla else int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position=_max_position(raw, family),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        has_qkv_bias=True if family == "qwen2" else has_bias,
        has_o_bias=False if family == "qwen2" else has_bias,
        has_mlp_bias=bool(raw.get("mlp_bias", False)),
        has_qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", *HYBRID_FAMILIES),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_ids=_eos(raw.get("eos_token_id")),
        moe=moe_spec(raw) if _has_experts(raw, family) else None,
        mla=mla,
        linear=linear_spec(raw, family, int(head_dim)) if family in HYBRID_FAMILIES else None,
        sliding=sliding_spec(raw, family) if family in SLIDING_FAMILIES else None,
        num_nextn_layers=int(raw.get("num_nextn_predict_layers") or 0) if mla else 0,
        quant=_weight_quant(raw, family),
        indexer=indexer_spec(raw, family) if family in DSA_FAMILIES else None,
    )


def _weight_quant(raw: Mapping[str, Any], family: str) -> QuantSpec | None:
    """FP8 weights the loader dequantizes (``model.quant``); gpt-oss's MXFP4 experts are its
    own loader's (``model.gpt_oss_loader``), and the sliding-window families' loaders take no
    FP8."""
    if (family, quant_method(raw)) == ("gpt_oss", MXFP4):
        return None
    quant = quant_spec(raw)
    if quant is not None and family in SLIDING_FAMILIES:
        raise ValueError(
            f"quantized {family} checkpoints ({quant_method(raw)!r}) are not supported"
        )
    return quant


def _dense_width_key(family: str) -> str:
    """Qwen3.5-MoE has no dense MLP (every layer sparse): its width is an expert's."""
    return "moe_intermediate_size" if family == "qwen3_5_moe" else "intermediate_size"


def _has_experts(raw: Mapping[str, Any], family: str) -> bool:
    if family in ("qwen3_next", "qwen3_5_moe"):
        return bool(raw.get("num_experts"))
    return family in ("qwen3_moe", *MLA_FAMILIES)


def mla_spec(raw: Mapping[str, Any]) -> MLASpec:
    """The MLA attention of a DeepSeek-V3 config; the softmax scale as transformers has it:
    ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under a
    scaled rope that names ``mscale_all_dim``."""
    q_lora = raw.get("q_lora_rank")
    nope, rope = int(_need(raw, "qk_nope_head_dim")), int(_need(raw, "qk_rope_head_dim"))
    scale = (nope + rope) ** -0.5
    spec = _rope(raw)
    if spec.rope_type != "default" and spec.mscale_all_dim:
        scale *= yarn_mscale(spec.factor, spec.mscale_all_dim) ** 2
    return MLASpec(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(_need(raw, "kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(_need(raw, "v_head_dim")),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        softmax_scale=scale,
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def moe_spec(raw: Mapping[str, Any]) -> MoESpec:
    """The MoE part of a Qwen3-MoE or DeepSeek-V2/V3 config (``model_type`` tells which)."""
    num_layers = int(_need(raw, "num_hidden_layers"))
    num_experts = int(
        raw.get("num_experts") or raw.get("n_routed_experts") or _need(raw, "num_local_experts")
    )
    top_k = int(_need(raw, "num_experts_per_tok"))
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not in [1, {num_experts}]")
    common = dict(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(_need(raw, "moe_intermediate_size")),
        # Qwen3.5-MoE's router always renormalises (its config has no such field)
        norm_topk_prob=bool(raw.get("norm_topk_prob", raw.get("model_type") == "qwen3_5_moe_text")),
    )
    if str(raw.get("model_type", "")).startswith(("deepseek", "glm_moe_dsa")):
        first_dense = int(raw.get("first_k_dense_replace") or 0)
        freq = int(raw.get("moe_layer_freq") or 1)
        kinds = raw.get("mlp_layer_types")  # DeepSeek-V3.2 / GLM-5 name them per layer
        if kinds and len(kinds) != num_layers:
            raise ValueError(f"mlp_layer_types has {len(kinds)} entries for {num_layers} layers")
        n_group = int(raw.get("n_group") or 1)
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        scoring = raw.get("scoring_func") or "sigmoid"
        if scoring != "sigmoid":
            raise ValueError(f"scoring_func {scoring!r} is not supported (only sigmoid)")
        return MoESpec(
            **common,  # type: ignore[arg-type]
            sparse_layers=frozenset(
                i
                for i in range(num_layers)
                if (kinds[i] == "sparse" if kinds else i >= first_dense and i % freq == 0)
            ),
            scoring="sigmoid",
            n_group=n_group,
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            num_shared_experts=int(raw.get("n_shared_experts") or 0),
            has_score_bias=(raw.get("topk_method") or "noaux_tc") == "noaux_tc",
        )
    dense_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    step = int(raw.get("decoder_sparse_step") or 1)
    sparse = frozenset(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    return MoESpec(**common, sparse_layers=sparse, shared_expert_size=shared)  # type: ignore[arg-type]


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ValueError(
            f"architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu" and ARCHITECTURES[known[0]] != "gemma3":  # its hidden_activation: hf_sliding
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    return known[0]


def _need(raw: Mapping[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise KeyError(f"missing field {key!r}")
    return raw[key]


def _rope(raw: Mapping[str, Any]) -> RopeSpec:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})")
    if rope_type == "default":
        return RopeSpec(theta=theta)
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":  # DeepSeek: the context's growth
        factor = int(_need(raw, "max_position_embeddings")) / int(
            _need(params, "original_max_position_embeddings")
        )
    attention_factor = params.get("attention_factor")
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(_need({"factor": factor}, "factor")),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original or raw.get("max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _max_position(raw: Mapping[str, Any], family: str) -> int:
    """Sliding-window attention equals full attention on prompts that fit in the window."""
    limit = int(raw.get("max_position_embeddings") or 2048)
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", family == "llama")
    if window and uses_window:
        limit = min(limit, int(window))
    return limit


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
