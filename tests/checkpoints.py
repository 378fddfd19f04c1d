"""Tiny random checkpoints of each supported family, built offline with ``transformers``.

q/k projections are scaled up so attention is far from uniform: a RoPE or mask bug then moves
logits by far more than the comparison tolerances. Seeds are fixed per family.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV32Config,
    Gemma3TextConfig,
    GlmMoeDsaConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS: dict[str, Callable[[], object]] = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE),
    "mistral": lambda: MistralConfig(**COMMON, tie_word_embeddings=True, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False, rope_theta=1e6),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}
FAMILIES = tuple(CONFIGS)  # the dense ones; the MoE families below are tested on their own
# Qwen3-MoE: 8 experts, top 2, layer 1 dense (mlp_only_layers), 0 and 2 sparse.
MOE_COMMON = dict(COMMON, num_hidden_layers=3, moe_intermediate_size=32, num_experts=8)
CONFIGS["qwen3_moe"] = lambda: Qwen3MoeConfig(
    **MOE_COMMON, head_dim=32, num_experts_per_tok=2, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
)  # fmt: skip
# DeepSeek-V3: MLA (low-rank q; q_lora_rank=None overrides it), YaRN with both mscales (the
# rope scale and the softmax scale both move), 16 experts in 4 groups, top 2 groups, top 4,
# one shared expert, layer 0 dense.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}
CONFIGS["deepseek_v3"] = lambda: DeepseekV3Config(
    **dict(COMMON, num_hidden_layers=3, num_key_value_heads=4), q_lora_rank=48,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
    moe_intermediate_size=32, n_routed_experts=16, n_group=4, topk_group=2,
    num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, rope_scaling=YARN, tie_word_embeddings=False,
)  # fmt: skip
# The hybrids (gated DeltaNet + gated full attention): odd shapes (3 value heads per key head,
# key and value head dims 12 and 10, a quarter of each attention head rotated), the kinds in
# an irregular order; Qwen3-Next with 8 experts, top 2, a gated shared expert, layer 2 dense.
HYBRID_COMMON = dict(
    COMMON, num_hidden_layers=5, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
    linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                 "full_attention"],
)  # fmt: skip
CONFIGS["qwen3_5"] = lambda: Qwen3_5TextConfig(**HYBRID_COMMON, tie_word_embeddings=False)
CONFIGS["qwen3_next"] = lambda: Qwen3NextConfig(
    **HYBRID_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[2],
    tie_word_embeddings=True,
)  # fmt: skip
# Qwen3.5-MoE: every layer sparse (8 experts, top 2, renormalised, a gated shared expert).
CONFIGS["qwen3_5_moe"] = lambda: Qwen3_5MoeTextConfig(
    **{k: v for k, v in HYBRID_COMMON.items() if k != "intermediate_size"}, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
    tie_word_embeddings=False,
)  # fmt: skip
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# gpt-oss: sliding (window 24), full, sliding; 6 heads of 12 over 2 KV heads (q is 72 wide
# in a hidden of 96), 5 experts, top 2, a SwiGLU clamp of 1 (it bites at these scales),
# YaRN without truncation. hidden and the expert width are multiples of 32 (MXFP4 blocks).
GPT_OSS_YARN = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64,
}  # fmt: skip
CONFIGS["gpt_oss"] = lambda: GptOssConfig(
    **dict(COMMON, hidden_size=96, intermediate_size=64, num_hidden_layers=3,
           num_attention_heads=6, max_position_embeddings=2048), head_dim=12,
    num_local_experts=5, num_experts_per_tok=2, sliding_window=24, swiglu_limit=1.0,
    rope_parameters=GPT_OSS_YARN, tie_word_embeddings=False,
)  # fmt: skip
# Gemma 3: sliding (window 24), full, sliding, sliding; 6 heads of 16 over 2 KV heads in a
# hidden of 72; the global layers' rope linear x8 at base 1e6, the local ones' at 1e4;
# query_pre_attn_scalar 20 (not head_dim); the (1 + weight) norms randomised.
CONFIGS["gemma3"] = lambda: Gemma3TextConfig(
    **dict(COMMON, hidden_size=72, intermediate_size=96, num_hidden_layers=4,
           num_attention_heads=6), head_dim=16, sliding_window=24, query_pre_attn_scalar=20,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
)  # fmt: skip
# DeepSeek-V3.2 / GLM-5 (DSA): DeepSeek-V3's MLA and experts plus an indexer of 6 heads of 24
# (8 of them roped) picking the top 12 keys, far fewer than the test prompts: past 12 tokens
# every query attends to 12 keys only. GLM-5's layer 2 reuses layer 1's choice ("shared").
DSA_COMMON = dict(
    **dict(COMMON, num_hidden_layers=3, num_key_value_heads=4), q_lora_rank=48,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
    moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, index_topk=12,
    index_head_dim=24, index_n_heads=6, tie_word_embeddings=False,
)  # fmt: skip
CONFIGS["deepseek_v32"] = lambda: DeepseekV32Config(
    **DSA_COMMON, n_group=4, topk_group=2, rope_parameters=YARN
)
CONFIGS["glm_moe_dsa"] = lambda: GlmMoeDsaConfig(**DSA_COMMON, index_topk_pattern="FFS")
DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa")
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")
SEEDS = {family: i for i, family in enumerate(CONFIGS)}


def make_checkpoint(family: str, path: Path, sharded: bool = False, **overrides: object) -> Path:
    """``overrides`` replace config fields (e.g. ``num_key_value_heads=1``)."""
    torch.manual_seed(SEEDS[family])
    config = CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "wq_b.weight")):
                param.mul_(20.0)
            if name.endswith("kv_a_proj_with_mqa.weight"):  # the roped key part: 20x
                param[-config.qk_rope_head_dim :].mul_(20.0)  # type: ignore[attr-defined]
            if name.endswith("a_layernorm.weight"):  # q_a / kv_a: not all ones
                param.copy_(torch.rand_like(param) + 0.5)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(torch.rand_like(param) * 4 + 2)
            if family == "gemma3" and name.endswith("norm.weight"):  # (1 + weight) norms;
                param.normal_(0.0, 0.3)  # q/k ones of 3..7 would make a softmax of ~1e2 logits
            if name.endswith("mlp.gate.weight"):  # a router: spread, no near-ties
                param.normal_(0.0, 0.15)
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            if name.endswith(("layernorm.weight", "model.norm.weight")) and family in (
                *HYBRID_FAMILIES,
                "gemma3",
            ):
                param.normal_(0.0, 0.3)  # a (1 + weight) norm: the 1 must be added exactly once
            if name.endswith("self_attn.sinks"):  # sinks that take a share of the mass
                param.normal_(0.0, 1.0)
            if name.endswith("mlp.router.weight"):  # logits of the router bias's size
                param.normal_(0.0, 0.1)
            if family == "gpt_oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.normal_(0.0, 0.2)  # the SwiGLU clamp bites
            if name.endswith("A_log"):  # slow decays: a state carries far (the carry matters)
                param.copy_(torch.empty_like(param).uniform_(0.005, 0.05).log())
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(torch.rand_like(param) + 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # big enough to change choices
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "5GB")
    return path


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def prompt(length: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (length,), generator=g)]


def add_byte_tokenizer(path: Path) -> Path:
    """Give a checkpoint a byte-level BPE ``tokenizer.json`` (each of the 256 bytes one token,
    no merges), so that ``text`` is served: a text of n ASCII characters is n tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


MTP = "model.layers.3."  # the MTP layer of with_mtp_layer's 3-layer DeepSeek-V3


def with_mtp_layer(root: Path) -> Path:
    """A tiny DeepSeek-V3 under ``root / "target"`` with an MTP layer (its donor beside it)."""
    target = make_checkpoint("deepseek_v3", root / "target")
    donor = make_checkpoint("deepseek_v3", root / "donor", num_hidden_layers=4)
    tensors = load_file(target / "model.safetensors")
    tensors |= {k: v for k, v in load_file(donor / "model.safetensors").items() if MTP in k}
    g = torch.Generator().manual_seed(7)
    hidden, vocab = tensors["model.norm.weight"].shape[0], tensors["lm_head.weight"].shape[0]
    tensors["model.norm.weight"] = torch.rand(hidden, generator=g) + 0.5  # the target's
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{MTP}{name}.weight"] = torch.rand(hidden, generator=g) + 0.5
    tensors[MTP + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    tensors[MTP + "shared_head.head.weight"] = torch.randn(vocab, hidden, generator=g) * 0.3
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return target
