"""Tensor parallelism against transformers: real gloo groups of 2 and 4 CPU processes.

Each rank loads its slices of the checkpoint and keeps its KV heads; the last token's fp32
logits on every rank, and every layer's K/V reassembled across the ranks by the head rule
(``parallel.gather_kv_heads``), must equal transformers' within 1e-4. The models cover the
three dense families, Qwen3-MoE (experts split per expert, one all-reduce after the
routed experts; 2 layers, layer 0 sparse, so layer 1's K is within the dense tolerance) and
DeepSeek-V3 (MLA: the query heads split, the latent replicated, so every rank's pool holds
the same rows, byte for byte) and both KV-head regimes: heads split over the ranks (2 KV
heads at TP 2) and replicated (1 KV head at TP 2; 2 and 1 at TP 4). q/k weights are scaled
x20, so a RoPE, mask or head-slicing bug moves logits by far more than the tolerance. One
group runs every case, so the processes start once per TP size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.model.parallel import gather_kv_heads
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import hf_forward, hf_mla_forward, hf_model, prompt
from tests.integration.model.tp_ranks import run_group

TOL = 1e-4
# case: (family, num_key_value_heads)
CASES = {
    2: {"llama": ("llama", 2), "qwen2": ("qwen2", 2), "qwen3": ("qwen3", 2),
        "llama_kv1": ("llama", 1), "qwen3_kv1": ("qwen3", 1), "qwen3_moe": ("qwen3_moe", 2),
        "deepseek_v3": ("deepseek_v3", 4)},
    4: {"qwen2": ("qwen2", 2), "qwen3_kv1": ("qwen3", 1)},
}  # fmt: skip
OVERRIDES: dict[str, dict[str, object]] = {
    "qwen3_moe": {"num_hidden_layers": 2, "mlp_only_layers": [1]},
}
LONG, SHORT = prompt(45, seed=1), prompt(20, seed=2)
MLA_CASES = ("deepseek_v3",)  # an MLA pool: no K/V heads, one latent row per token
ALL = [(size, name) for size, cases in CASES.items() for name in cases if name not in MLA_CASES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    names = {name: case for cases in CASES.values() for name, case in cases.items()}
    return {
        name: make_checkpoint(family, root / name, sharded=family == "qwen2",
                              num_key_value_heads=kv, **OVERRIDES.get(name, {}))
        for name, (family, kv) in names.items()
    }  # fmt: skip


@pytest.fixture(scope="module")
def groups(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Every TP size's group, run once: ``out[size]`` holds its ranks' results."""
    out = {}
    for size, cases in CASES.items():
        out[size] = tmp_path_factory.mktemp(f"tp{size}")
        run_group(size, {name: checkpoints[name] for name in cases}, LONG, SHORT, out[size])
    return out


def rank_results(out_dir: Path, name: str, size: int) -> list[dict]:
    return [torch.load(out_dir / f"{name}.{rank}.pt") for rank in range(size)]


@pytest.mark.parametrize(("size", "name"), ALL)
def test_logits_and_kv_match_transformers(checkpoints, groups, size, name):
    model = hf_model(checkpoints[name])
    num_kv_heads = model.config.num_key_value_heads
    results = rank_results(groups[size], name, size)
    for ids, key in ((LONG, "long"), (SHORT, "short")):
        hf_logits, hf_kv = hf_forward(model, ids)
        for result in results:  # the residual stream, hence the logits, is the same on all
            torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
        for layer, (hf_k, hf_v) in enumerate(hf_kv):
            for index, hf_part in ((0, hf_k), (1, hf_v)):
                per_rank = [result[f"{key}_kv"][layer][index] for result in results]
                whole = gather_kv_heads(per_rank, num_kv_heads)
                torch.testing.assert_close(whole, hf_part, atol=TOL, rtol=0)


@pytest.mark.parametrize(("size", "name"), ALL)
def test_each_rank_pool_holds_only_its_heads(groups, size, name):
    """Split heads: one per rank at TP 2 with 2 KV heads; replicated: every rank keeps one."""
    kv = CASES[size][name][1]
    for result in rank_results(groups[size], name, size):
        k, v = result["long_kv"][0]
        assert k.shape == v.shape == (len(LONG), max(1, kv // size), k.shape[-1])


def test_mla_latent_is_the_same_on_every_rank_and_matches_transformers(checkpoints, groups):
    model = hf_model(checkpoints["deepseek_v3"])
    results = rank_results(groups[2], "deepseek_v3", 2)
    for ids, key in ((LONG, "long"), (SHORT, "short")):
        hf_logits, hf_rows = hf_mla_forward(model, ids)
        for result in results:
            torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
        for layer, expected in enumerate(hf_rows):
            rows = [result[f"{key}_kv"][layer][0][:, 0] for result in results]  # [S, r + rope]
            assert all(torch.equal(rows[0], other) for other in rows[1:])
            torch.testing.assert_close(rows[0], expected, atol=TOL, rtol=1e-5)
