"""A runner of any supported family's shape (Llama, Qwen, DeepSeek-V3) with random weights
made in memory, on any device.

For benchmarks: an 8B-shaped model on a GPU without 16 GB of safetensors to write and read.
The weights go through the loader's own fusion (``fuse_weights``), so the model is the one
the worker would run for a real checkpoint of that shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from prefill_worker.kv.layout import LAYER_MAJOR, MLA, KVLayout
from prefill_worker.model import Runner, create_model
from prefill_worker.model.hf_config import ModelSpec, spec_from_dict
from prefill_worker.model.kv_cache import DTYPE_NAMES, KVCache
from prefill_worker.model.loader import expected_shapes, fuse_weights
from prefill_worker.model.moe import create_moe_backend
from prefill_worker.model.parallel import SINGLE

# Llama-3-8B's config.json, the fields the model reads.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


class RandomTensors:
    """``TensorSource`` of random tensors shaped as the spec expects: norms 1, the rest
    N(0, 0.02), so activations stay finite in bf16 at any depth."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int):
        self.shapes = expected_shapes(spec)
        self.dtype, self.device = dtype, device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        return out.normal_(0.0, 0.02, generator=self.generator)

    def linear(self, name: str) -> torch.Tensor:
        return self.get(name)

    def maybe(self, name: str, needed: bool) -> torch.Tensor | None:
        return self.get(name) if needed else None


def random_runner(
    config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str,
    page_size: int,
    num_pages: int,
    seed: int = 0,
    pool_layout: str = LAYER_MAJOR,
) -> tuple[Runner, ModelSpec]:
    """A ``Runner`` over a KV pool of ``num_pages`` pages (in ``pool_layout``; an MLA
    model's is always ``mla``) for a model shaped as ``config``."""
    spec = spec_from_dict(config)
    weights = fuse_weights(spec, RandomTensors(spec, dtype, device, seed))
    experts = create_moe_backend("auto", device, dtype)
    model, attention = create_model(spec, weights, SINGLE, experts, attention_backend)
    if spec.mla is not None:
        pool_layout = MLA
    layout = KVLayout(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        DTYPE_NAMES[dtype],
        page_size,
        1,
        pool_layout,
    )
    kv_cache = KVCache(dataclasses.replace(layout, num_pages=num_pages), device)
    return Runner(model, kv_cache, attention), spec
