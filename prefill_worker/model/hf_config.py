"""The one adapter that reads a Hugging Face ``config.json`` into a typed ``ModelSpec``.

HF configs are fuzzy: field names moved between versions (``rope_theta`` and ``rope_scaling``
became ``rope_parameters``; ``torch_dtype`` became ``dtype``), some are optional (``head_dim``),
some mean different things per family (Qwen2 always has q/k/v bias). All of that is decided
here, once, so the model code reads plain typed fields. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")


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


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything the model code needs from config.json, already resolved per family."""

    architecture: str  # a key of ARCHITECTURES
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
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
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=int(_need(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_need(raw, "intermediate_size")),
        num_layers=int(_need(raw, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw),
        max_position=_max_position(raw, family),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        has_qkv_bias=True if family == "qwen2" else has_bias,
        has_o_bias=False if family == "qwen2" else has_bias,
        has_mlp_bias=bool(raw.get("mlp_bias", False)),
        has_qk_norm=family == "qwen3",
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_ids=_eos(raw.get("eos_token_id")),
    )


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ValueError(
            f"architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"quantized checkpoints ({method!r}) are not supported")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
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
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original or raw.get("max_position_embeddings", 8192)),
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
