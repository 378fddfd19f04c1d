"""The DeepSeek MoE block against transformers' own ``DeepseekV3MoE`` on the same weights.

A tiny random ``DeepseekV3ForCausalLM`` is saved by transformers (per-expert tensors, as
DeepSeek ships them); our block fuses its sparse layer's tensors from the safetensors file
and runs on the same hidden states as the HF module, fp32, 1e-5. Sigmoid scoring, a random
``e_score_correction_bias`` big enough to change choices, 16 experts in 4 groups (top-2
groups), top 4, two shared experts, ``routed_scaling_factor`` 2.5, ``first_k_dense_replace``
1. The MLA attention is not run (not ours yet): only the MLP modules are compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from prefill_worker.model.hf_config import moe_spec
from prefill_worker.model.moe import create_moe_backend
from prefill_worker.model.moe.block import MoEWeights, fuse_moe, moe_mlp, moe_shapes
from prefill_worker.model.parallel import SINGLE, TPGroup, even_range
from prefill_worker.model.sharding import DEEPSEEK_MOE, split_in

TOL = 1e-5
CPU = torch.device("cpu")
CONFIG = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=16,
    n_group=4, topk_group=2, num_experts_per_tok=4, n_shared_experts=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("dsv3") / "ckpt"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(checkpoint):  # type: ignore[no-untyped-def]
    return DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def reader(path: Path, tp: TPGroup = SINGLE):  # type: ignore[no-untyped-def]
    """``get(name)``: rank ``tp.rank``'s slice of the tensor, by the DeepSeek MoE table."""
    handle = safe_open(path / "model.safetensors", framework="pt")

    def get(name: str) -> torch.Tensor:
        dim = split_in(DEEPSEEK_MOE, name, "deepseek_v3").dim
        if dim is None:
            return handle.get_tensor(name)
        piece = handle.get_slice(name)
        owned = even_range(piece.get_shape()[dim], tp)
        cut = slice(owned.start, owned.stop)
        return piece[cut] if dim == 0 else piece[:, cut]

    return get


def spec_of(path: Path):  # type: ignore[no-untyped-def]
    return moe_spec(json.loads((path / "config.json").read_text()))


def hidden_states(num_tokens: int = 96) -> torch.Tensor:
    return torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(1))


def hf_block(hf, layer: int, h: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf.model.layers[layer].mlp(h[None])[0]


def test_config_reads_as_deepseek_routing(checkpoint):
    spec = spec_of(checkpoint)
    assert spec.scoring == "sigmoid" and spec.has_score_bias
    assert (spec.n_group, spec.topk_group, spec.top_k) == (4, 2, 4)
    assert spec.sparse_layers == frozenset({1, 2}) and spec.num_shared_experts == 2


def test_the_checkpoint_holds_per_expert_tensors_as_shipped(checkpoint):
    spec = spec_of(checkpoint)
    with safe_open(checkpoint / "model.safetensors", framework="pt") as f:
        names = f.keys()
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    for layer in sorted(spec.sparse_layers):
        for name, shape in moe_shapes(spec, 64, f"model.layers.{layer}.mlp.").items():
            assert stored[name] == shape


@pytest.mark.parametrize("backend", ["grouped", "naive"])
def test_block_equals_transformers(checkpoint, hf, backend):
    spec, h = spec_of(checkpoint), hidden_states()
    for layer in sorted(spec.sparse_layers):
        weights = fuse_moe(spec, reader(checkpoint), f"model.layers.{layer}.mlp.")
        out = moe_mlp(h, weights, spec, create_moe_backend(backend, CPU))
        torch.testing.assert_close(out, hf_block(hf, layer, h), atol=TOL, rtol=0)


def test_two_ranks_partial_sums_add_up_to_transformers(checkpoint, hf):
    """TP 2 without processes: each rank's block on its slices (no all-reduce at TP 1), summed,
    is the whole block: the one all-reduce is all a group needs."""
    spec, h, backend = spec_of(checkpoint), hidden_states(), create_moe_backend("grouped", CPU)
    parts = []
    for rank in (0, 1):
        weights = fuse_moe(spec, reader(checkpoint, TPGroup(rank, 2)), "model.layers.2.mlp.")
        assert weights.gate_up.shape == (16, 24, 64) and weights.shared_down.shape == (64, 24)
        parts.append(moe_mlp(h, weights, spec, backend))
    torch.testing.assert_close(parts[0] + parts[1], hf_block(hf, 2, h), atol=TOL, rtol=0)


def test_ignoring_the_correction_bias_fails(checkpoint, hf):
    """Guards the comparison: experts chosen without ``e_score_correction_bias`` differ."""
    spec, h = spec_of(checkpoint), hidden_states()
    weights = fuse_moe(spec, reader(checkpoint), "model.layers.1.mlp.")
    unbiased = MoEWeights(
        **{f: getattr(weights, f) for f in MoEWeights.__slots__} | {"score_bias": None}
    )
    out = moe_mlp(h, unbiased, spec, create_moe_backend("grouped", CPU))
    assert (out - hf_block(hf, 1, h)).abs().max() > 100 * TOL


def test_group_limit_matters(checkpoint, hf):
    """Guards the comparison: top-k over all experts (no group limit) differs."""
    spec, h = spec_of(checkpoint), hidden_states()
    weights = fuse_moe(spec, reader(checkpoint), "model.layers.1.mlp.")
    flat = type(spec)(**{f: getattr(spec, f) for f in spec.__slots__} | {"topk_group": 4})
    out = moe_mlp(h, weights, flat, create_moe_backend("grouped", CPU))
    assert (out - hf_block(hf, 1, h)).abs().max() > 100 * TOL
