"""Expert placement (torch-free): contiguous and explicit maps, and every refusal's reason;
the config's ``parallel.ep_size`` rule; ``check-config``'s expert bytes per rank."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from prefill_worker.model.hf_config import ModelSpec, read_spec
from prefill_worker.model.moe.ep import (
    EP_EXCHANGES,
    has_deep_ep,
    resolve_exchange_name,
    share,
)
from prefill_worker.model.moe.memory import expert_bytes_per_rank, expert_note
from prefill_worker.model.moe.placement import (
    ExpertPlacement,
    check_expert_parallel,
    contiguous,
    make_placement,
)
from prefill_worker.service.config import ConfigError, load_config


def test_contiguous_gives_each_rank_a_block():
    placement = contiguous(8, 4)
    assert [placement.local_experts(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert placement.max_local() == 2


def test_an_explicit_map_numbers_a_rank_s_experts_in_global_order():
    placement = make_placement(6, 2, [1, 0, 1, 1, 0, 1])
    assert placement.local_experts(0) == (1, 4)
    assert placement.local_experts(1) == (0, 2, 3, 5)
    assert placement.max_local() == 4


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ((6, 4, ()), "6 routed experts do not split over 4"),
        ((4, 2, [0, 1, 0]), "names 3 experts; the model routes 4"),
        ((4, 2, [0, 1, 2, 0]), "names rank 2, not one of the 2 EP ranks"),
        ((4, 2, [0, 0, 0, 0]), "gives rank 1 no expert"),
        ((4, 2, [0, -1, 1, 0]), "names rank -1"),
    ],
)
def test_a_bad_placement_is_refused_with_its_reason(args, reason):
    with pytest.raises(ValueError, match=reason):
        make_placement(*args)


QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [1], "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip


def moe_spec(tmp_path: Path, family: str = "qwen3_moe") -> ModelSpec:
    """Qwen3-MoE's spec from its config.json alone: 8 experts, layers 0 and 2 sparse."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    return dataclasses.replace(read_spec(tmp_path), family=family)


def test_expert_parallel_is_1_or_the_group(tmp_path):
    spec = moe_spec(tmp_path)
    assert check_expert_parallel(spec, 4, 1) is None
    assert check_expert_parallel(spec, 2, 2) == contiguous(8, 2)
    assert check_expert_parallel(spec, 2, 2, [1, 0] * 4) == ExpertPlacement((1, 0) * 4, 2)
    with pytest.raises(ValueError, match=re.escape("ep_size 2 must be 1 or parallel.tp_size (4)")):
        check_expert_parallel(spec, 4, 2)
    with pytest.raises(
        ValueError, match=re.escape("expert_placement needs parallel.ep_size above 1")
    ):
        check_expert_parallel(spec, 2, 1, [0, 1] * 4)
    with pytest.raises(ValueError, match="not Qwen3MoeForCausalLM \\(family 'qwen3'\\)"):
        check_expert_parallel(dataclasses.replace(spec, moe=None, family="qwen3"), 2, 2)
    with pytest.raises(ValueError, match="serves the MoE families qwen3_moe, deepseek_v3, not"):
        check_expert_parallel(moe_spec(tmp_path, "qwen3_next"), 2, 2)


def test_across_attention_dp_ranks_ep_size_is_1_or_the_dp_ranks(tmp_path):
    spec = moe_spec(tmp_path)
    assert check_expert_parallel(spec, 1, 4, dp_size=4) == contiguous(8, 4)
    assert check_expert_parallel(spec, 1, 1, dp_size=4) is None
    assert check_expert_parallel(spec, 1, 2, [0, 1] * 4, 2) == ExpertPlacement((0, 1) * 4, 2)
    says = "ep_size 2 must be 1 or parallel.dp_size (4) x tp_size (1): experts are placed over"
    with pytest.raises(ValueError, match=re.escape(says)):
        check_expert_parallel(spec, 1, 2, dp_size=4)
    with pytest.raises(ValueError, match="gives rank 1 no expert"):
        check_expert_parallel(spec, 1, 2, [0] * 8, 2)
    with pytest.raises(ValueError, match="serves the MoE families"):
        check_expert_parallel(dataclasses.replace(spec, moe=None, family="qwen3"), 1, 2, (), 2)


def test_the_memory_note_over_dp_ranks_says_the_rest_is_whole(tmp_path):
    spec = moe_spec(tmp_path)
    note = expert_note(spec, contiguous(8, 2), "float32", 4, dp=True)
    assert note.startswith("expert parallel 2: 4 of 8 routed experts per rank, whole;")
    assert "whole on each of the 2 attention-DP ranks (at DP 2 without EP: every expert" in note
    assert "TP" not in note


def test_the_config_takes_ep_size_dp_size_and_refuses_dp_x_tp():
    flags = ["parallel.dp_size=2", "parallel.ep_size=2"]
    assert load_config(None, env={}, overrides=flags).parallel.ep_size == 2
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=["parallel.dp_size=2", "parallel.ep_size=4"])
    assert any("ep_size 4 must be 1 or dp_size (2) x tp_size (1)" in p for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=[*flags, "parallel.ep_exchange=deepep"])
    says = "ep_exchange 'deepep' at dp_size 2: across attention-DP ranks only the torch"
    assert any(says in p for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=[*flags, "parallel.tp_size=2", "parallel.ep_size=4"])
    assert any("dp_size 2 with tp_size > 1: not built" in p for p in info.value.problems)


def test_the_config_refuses_an_ep_size_other_than_1_or_tp_size():
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=["parallel.tp_size=4", "parallel.ep_size=2"])
    assert any("ep_size 2 must be 1 or tp_size (4)" in p for p in info.value.problems)
    config = load_config(None, env={}, overrides=["parallel.tp_size=2", "parallel.ep_size=2"])
    assert config.parallel.ep_size == 2 and config.parallel.expert_placement == []


def test_share_covers_every_token_once():
    for num_tokens in (0, 1, 5, 64):
        for size in (1, 2, 3, 4):
            covered = [
                i for r in range(size) for i in range(num_tokens)[share(num_tokens, r, size)]
            ]
            assert covered == list(range(num_tokens))


def test_expert_bytes_per_rank(tmp_path):
    spec = moe_spec(tmp_path)  # 8 experts of 3 x 32 x 64 parameters, 2 sparse layers
    one = 3 * 32 * 64 * 2  # bf16
    assert expert_bytes_per_rank(spec, contiguous(8, 2), 2) == [4 * one * 2] * 2
    lopsided = ExpertPlacement((0,) * 7 + (1,), 2)
    assert expert_bytes_per_rank(spec, lopsided, 2) == [7 * one * 2, one * 2]
    note = expert_note(spec, lopsided, "bfloat16", 2)
    assert "1 to 7 of 8 routed experts per rank" in note


def test_the_exchange_registry_has_deepep_only_where_it_imports():
    cpu = torch.device("cpu")
    assert resolve_exchange_name("torch", cpu) == "torch"
    assert ("deepep" in EP_EXCHANGES) == has_deep_ep()
    if not has_deep_ep():
        with pytest.raises(ValueError, match=re.escape("'deepep' (deep_ep is not installed here)")):
            resolve_exchange_name("deepep", cpu)
    else:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            resolve_exchange_name("deepep", cpu)
