"""Tensor parallelism against transformers: real gloo groups of 2 and 4 CPU processes.

Each rank loads its slices of the checkpoint and keeps its KV heads; the fp32 logits of every
prompt's last token on every rank, and every layer's K/V reassembled across the ranks by the
head rule (``parallel.gather_kv_heads``), must equal transformers' within 1e-4. Every family
the worker serves runs at TP 2 and TP 4 (the test models have 4 query heads), in both
KV-head regimes::

    TP 2   2 KV heads: split, one per rank (GQA: 2 query heads each)
           1 KV head:  replicated on both ranks
    TP 4   4 KV heads: split, one per rank
           2 KV heads: replicated, each on 2 ranks

each with a chunked prompt batched beside a short one, then its rest beside a prefix-cache
hit on its first two pages (``tp_ranks`` draws the batches). Qwen3-MoE has 2 layers, layer 0
sparse (experts split per expert, one all-reduce), so layer 1's K is within the dense
tolerance. q/k weights are scaled x20, so a RoPE, mask, page or head-slicing bug moves logits
by far more than the tolerance. One world of 4 processes starts once and runs every case
(TP 2 on its two halves side by side). DeepSeek-V3 (MLA) runs at TP 2: the query heads
split, the latent replicated, so every rank's pool holds the same rows, byte for byte.
gpt-oss and Gemma 3 (6 query heads over 2 KV heads, windows of 24 under 45-token prompts) run
at TP 2, their sliding layers' K/V compared over the positions transformers keeps.
The hybrids (Qwen3.5 dense, Qwen3-Next MoE with its grouped in_proj_qkvz) run at TP 2: each
rank holds one of the 2 linear key heads with its 3 value heads and one full-attention KV
head; every full layer's K/V and every linear layer's conv window and recurrent state,
reassembled from both ranks' slots (``gather_linear_state``), equal transformers', and so do
the leader's whole slots (``model.state_gather``: what its transfer sends), gathered when a
prompt ends (not after a chunk that does not end it), the whole component what it describes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch

from prefill_worker.model.parallel import gather_kv_heads
from tests.checkpoints import make_checkpoint
from tests.integration.model.conftest import (
    hf_forward,
    hf_index_keys,
    hf_mla_forward,
    hf_model,
    prompt,
)
from tests.integration.model.tp_ranks import SPLIT, Prompts, result_path, run_world

TOL = 1e-4
# A family joins by a line here (its config in tests/checkpoints.py) and, if its pool is not
# per-head K/V (DeepSeek-V3's MLA latent is replicated, one plane), a check in KV_CHECKS.
FAMILY_OVERRIDES: dict[str, dict[str, object]] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {},
    "qwen3_moe": {"num_hidden_layers": 2, "mlp_only_layers": [1]},
}  # fmt: skip
KV_HEADS = {2: {"split": 2, "replicated": 1}, 4: {"split": 4, "replicated": 2}}
CASES = {
    size: {f"{family}_kv{kv}": (family, kv) for family in FAMILY_OVERRIDES for kv in kvs.values()}
    for size, kvs in KV_HEADS.items()
}
LONG, SHORT = prompt(45, seed=1), prompt(20, seed=2)
PROMPTS = Prompts(LONG, SHORT, LONG[:SPLIT] + prompt(11, seed=3))
ALL = [(size, name) for size, cases in CASES.items() for name in cases]
# an MLA pool: no K/V heads, one latent row per token (its own test below; 4 KV heads = heads)
CASES[2]["deepseek_v3"] = ("deepseek_v3", 4)
CASES[2]["deepseek_v32"] = ("deepseek_v32", 4)  # MLA + a replicated indexer (DSA)
HYBRIDS = ("qwen3_5", "qwen3_next")  # a state pool beside the KV: their own test below
SLIDING = ("gpt_oss", "gemma3")  # 6 heads: TP 2 only; transformers keeps a window's K/V
CASES[2] |= {family: (family, 2) for family in (*HYBRIDS, *SLIDING)}
# gpt-oss with a windowed sliding pool (cache.sliding_pool): two requests' quotas of pages
WINDOWED, SLIDING_PAGES = "gpt_oss_windowed", 14
CASES[2][WINDOWED] = ("gpt_oss", 2)
EXTRA = {WINDOWED: {"sliding_pages": SLIDING_PAGES}}  # build()'s extra arguments, per case


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    names = {name: case for cases in CASES.values() for name, case in cases.items()}
    return {
        name: make_checkpoint(family, root / name, sharded=family == "qwen2",
                              num_key_value_heads=kv, **FAMILY_OVERRIDES.get(family, {}))
        for name, (family, kv) in names.items()
    }  # fmt: skip


@pytest.fixture(scope="module")
def world(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case at every TP size, run once by one world of ranks: their results."""
    out = tmp_path_factory.mktemp("tp")
    cases = {
        size: {name: (checkpoints[name], EXTRA.get(name, {})) for name in names}
        for size, names in CASES.items()
    }
    run_world(cases, PROMPTS, out)
    return out


@pytest.fixture(scope="module")
def reference(checkpoints) -> Callable[[str, str], tuple]:
    """``reference(name, key)``: transformers' (logits, per-layer K/V) of a case's prompt,
    computed once per checkpoint (TP 2 and TP 4 share it)."""

    @cache
    def model(name: str) -> torch.nn.Module:
        return hf_model(checkpoints[name])

    @cache
    def forward(name: str, key: str) -> tuple:
        return hf_forward(model(name), getattr(PROMPTS, key))

    return forward


def rank_results(out_dir: Path, name: str, size: int) -> list[dict]:
    return [torch.load(result_path(out_dir, name, size, rank)) for rank in range(size)]


def check_head_kv(results: list[dict], key: str, hf_kv: list, num_kv_heads: int) -> None:
    """Every layer's K and V, reassembled across the ranks by the head rule, equal HF's."""
    for layer, (hf_k, hf_v) in enumerate(hf_kv):
        for index, hf_part in ((0, hf_k), (1, hf_v)):
            per_rank = [result[f"{key}_kv"][layer][index] for result in results]
            whole = gather_kv_heads(per_rank, num_kv_heads)
            torch.testing.assert_close(whole, hf_part, atol=TOL, rtol=0)


def check_window_kv(results: list[dict], key: str, hf_kv: list, num_kv_heads: int) -> None:
    """As ``check_head_kv``, over the positions transformers keeps: every one of a full
    layer, the last ``window - 1`` of a sliding layer (all a decode reads next)."""
    for layer, (hf_k, hf_v) in enumerate(hf_kv):
        for index, hf_part in ((0, hf_k), (1, hf_v)):
            per_rank = [result[f"{key}_kv"][layer][index] for result in results]
            whole = gather_kv_heads(per_rank, num_kv_heads)
            torch.testing.assert_close(whole[-len(hf_part) :], hf_part, atol=TOL, rtol=0)


# family -> its check of the ranks' pools, where not per-head K/V (check_head_kv's signature)
KV_CHECKS: dict[str, Callable[[list[dict], str, list, int], None]] = dict.fromkeys(
    SLIDING, check_window_kv
)


@pytest.mark.parametrize("key", ["long", "short", "hit"])
@pytest.mark.parametrize(("size", "name"), ALL)
def test_logits_and_kv_match_transformers(world, reference, size, name, key):
    family, num_kv_heads = CASES[size][name]
    hf_logits, hf_kv = reference(name, key)
    results = rank_results(world, name, size)
    for result in results:  # the residual stream, hence the logits, is the same on all
        torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
    KV_CHECKS.get(family, check_head_kv)(results, key, hf_kv, num_kv_heads)


@pytest.mark.parametrize(("size", "name"), ALL)
def test_each_rank_pool_holds_only_its_heads(world, size, name):
    """Split: KV / size heads per rank; replicated: every rank keeps one."""
    kv = CASES[size][name][1]
    for result in rank_results(world, name, size):
        k, v = result["long_kv"][0]
        assert k.shape == v.shape == (len(LONG), max(1, kv // size), k.shape[-1])


@pytest.mark.parametrize("key", ["long", "short", "hit"])
@pytest.mark.parametrize("family", SLIDING)
def test_sliding_window_families_match_transformers(world, reference, family, key):
    """gpt-oss (sinks split by head, experts with their biases split) and Gemma 3 at TP 2."""
    test_logits_and_kv_match_transformers(world, reference, 2, family, key)


def test_a_windowed_sliding_pool_matches_transformers_at_tp_2(world, reference):
    """gpt-oss at TP 2 with its sliding layers in their own page space: each rank plans the
    same entries, long's early sliding pages go back after its first chunk; the logits and
    every layer's K/V where transformers keeps it are the same."""
    results = rank_results(world, WINDOWED, 2)
    for key in ("long", "short"):
        hf_logits, hf_kv = reference(WINDOWED, key)
        for result in results:
            torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
        check_window_kv(results, key, hf_kv, 2)
    # the last windows, each kept from its last whole page's end (what a prefix hit on the
    # cached chain reads, kv/sliding.py): long's pages 0 to 2 (its whole pages end at 32,
    # whose window starts at 9), short's 0 and 1
    assert {result["sliding_pages_held"] for result in results} == {5}


def no_index_keys(model: torch.nn.Module, ids: list[int]) -> dict[int, torch.Tensor]:
    return {}


@pytest.mark.parametrize(
    ("family", "keys", "index_keys"),
    [
        ("deepseek_v3", ("long", "short", "hit"), no_index_keys),
        ("deepseek_v32", ("long", "hit"), hf_index_keys),  # both read index keys back
    ],
    ids=["deepseek_v3", "deepseek_v32"],
)
def test_mla_latent_is_the_same_on_every_rank_and_matches_transformers(
    checkpoints, world, family, keys, index_keys
):
    """DeepSeek-V3.2 (DSA) too: its indexer replicated, so each rank's index keys are the
    same, byte for byte, and transformers' (top 12 of prompts up to 45 tokens: the choice
    matters)."""
    model = hf_model(checkpoints[family])
    results = rank_results(world, family, 2)
    for key in keys:
        ids = getattr(PROMPTS, key)
        hf_logits, hf_rows = hf_mla_forward(model, ids)
        for layer, expected in index_keys(model, ids).items():
            got = [result[f"{key}_index"][layer] for result in results]
            assert all(torch.equal(got[0], other) for other in got[1:])
            torch.testing.assert_close(got[0], expected, atol=TOL, rtol=1e-5)
        for result in results:
            torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
        for layer, expected in enumerate(hf_rows):
            rows = [result[f"{key}_kv"][layer][0][:, 0] for result in results]  # [S, r + rope]
            assert all(torch.equal(rows[0], other) for other in rows[1:])
            torch.testing.assert_close(rows[0], expected, atol=TOL, rtol=1e-5)


def hf_hybrid_forward(model: torch.nn.Module, ids: list[int]):  # type: ignore[no-untyped-def]
    """(logits [S, vocab], [(k, v)] of each full layer [S, KV, D], [(conv [C, K-1],
    recurrent [Hv, Dk, Dv])] of each linear layer); a slot keeps the last K-1 conv inputs."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    kv, state = [], []
    for kind, layer in zip(model.config.layer_types, out.past_key_values.layers, strict=True):
        if kind == "full_attention":
            kv.append((layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)))
        else:
            state.append((layer.conv_states[0][0, :, 1:], layer.recurrent_states[0][0]))
    return out.logits[0].float(), kv, state


def gather_linear_state(per_rank: list[torch.Tensor], config) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """A conv window ``[C, K-1]`` from each rank's ``[C / size, K-1]``: every rank's channels
    are its q, then k, then v runs; the whole is all q, all k, all v."""
    size, key = len(per_rank), config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    runs = [part.split([key // size, key // size, value // size]) for part in per_rank]
    return torch.cat([runs[rank][block] for block in range(3) for rank in range(size)])


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_logits_kv_and_state_match_transformers(checkpoints, world, family):
    model = hf_model(checkpoints[family])
    results = rank_results(world, family, 2)
    for key in ("long", "short"):  # chunked, and batched beside it (no hit: no prefix cache)
        hf_logits, hf_kv, hf_state = hf_hybrid_forward(model, getattr(PROMPTS, key))
        for result in results:
            torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
        check_head_kv(results, key, hf_kv, num_kv_heads=2)
        for layer, (hf_conv, hf_recurrent) in enumerate(hf_state):
            convs = [result[f"{key}_conv"][layer] for result in results]
            recurrents = [result[f"{key}_recurrent"][layer] for result in results]
            assert recurrents[0].shape[0] == model.config.linear_num_value_heads // 2
            conv = gather_linear_state(convs, model.config)
            torch.testing.assert_close(conv, hf_conv, atol=TOL, rtol=1e-5)
            torch.testing.assert_close(torch.cat(recurrents), hf_recurrent, atol=TOL, rtol=1e-5)
            whole_conv, whole_recurrent = results[0][f"{key}_whole"][layer]  # what it sends
            torch.testing.assert_close(whole_conv, hf_conv, atol=TOL, rtol=1e-5)
            torch.testing.assert_close(whole_recurrent, hf_recurrent, atol=TOL, rtol=1e-5)
    assert all("long_whole" not in result for result in results[1:])  # the leader's alone
    assert results[0]["long_whole_after_first"] is False  # gathered when the prompt ended
    conv_dim = 2 * model.config.linear_num_key_heads * model.config.linear_key_head_dim + (
        model.config.linear_num_value_heads * model.config.linear_value_head_dim
    )
    assert results[0]["state_shapes"][0] == (conv_dim, model.config.linear_conv_kernel_dim - 1)
