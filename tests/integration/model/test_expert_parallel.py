"""Expert parallelism against tensor parallelism and transformers: real gloo groups of CPU
processes (``tp_ranks``, one world of 4 ranks started once).

At EP N (= TP N) each rank holds whole routed experts (its share, contiguous or by an explicit
map), reads only their tensors, and the tokens reach them by all-to-all. The same tiny random
Qwen3-MoE (8 experts, top 2; layer 0 sparse, 1 dense) and DeepSeek-V3 (16 experts in 4 groups,
top 4, a shared expert; MLA) run at TP 2, TP 2 / EP 2, TP 2 / EP 2 with an interleaved
placement, and TP 4 / EP 4, plus an FP8 (block 32 × 32) DeepSeek-V3 at EP 2: every rank's
last-token fp32 logits and every layer's KV (reassembled by the head rule; the MLA latent,
the same on every rank) equal transformers' (TP 1's reference) and the TP-2 run's within 1e-4.
The same world then runs the exchange alone with different token counts per rank.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from prefill_worker.model.parallel import gather_kv_heads
from tests.checkpoints import make_checkpoint
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.integration.model.conftest import hf_forward, hf_mla_forward, hf_model, prompt
from tests.integration.model.ep_exchange_ranks import TOKENS, check_exchange
from tests.integration.model.ep_exchange_ranks import result_path as exchange_path
from tests.integration.model.tp_ranks import SPLIT, Prompts, result_path, run_world

TOL = 1e-4
LONG, SHORT = prompt(45, seed=1), prompt(20, seed=2)
PROMPTS = Prompts(LONG, SHORT, LONG[:SPLIT] + prompt(11, seed=3))
KEYS = ("long", "short", "hit")
# as test_tensor_parallel's: layer 0 sparse, so layer 1's K is within the dense tolerance
OVERRIDES: dict[str, dict[str, object]] = {
    "qwen3_moe": {"num_hidden_layers": 2, "mlp_only_layers": [1]}
}
INTERLEAVED = {"qwen3_moe": [0, 1] * 4, "deepseek_v3": [1, 0] * 8}
# name -> (checkpoint, TP size, build's EP arguments)
RUNS = {
    f"{family}_{kind}": (family, size, ep)
    for family in ("qwen3_moe", "deepseek_v3")
    for kind, size, ep in (
        ("tp2", 2, {}),
        ("ep2", 2, {"ep_size": 2}),
        ("ep2_map", 2, {"ep_size": 2, "expert_placement": INTERLEAVED[family]}),
        ("ep4", 4, {"ep_size": 4}),
    )
}
RUNS["fp8_deepseek_v3_ep2"] = ("fp8_deepseek_v3", 2, {"ep_size": 2})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (the checkpoint the worker loads, the one transformers runs)."""
    root = tmp_path_factory.mktemp("ep_ckpt")
    out = {family: (make_checkpoint(family, root / family, **OVERRIDES.get(family, {})),) * 2
           for family in ("qwen3_moe", "deepseek_v3")}  # fmt: skip
    out["fp8_deepseek_v3"] = make_fp8_checkpoint("deepseek_v3", root / "fp8", block=(32, 32))
    return out


@pytest.fixture(scope="module")
def world(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ep")
    cases: dict[int, dict[str, object]] = {2: {}, 4: {}}
    for name, (source, size, ep) in RUNS.items():
        cases[size][name] = (checkpoints[source][0], ep)
    run_world(cases, PROMPTS, out, check_exchange)  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="module")
def reference(checkpoints):  # type: ignore[no-untyped-def]
    """``reference(source, key)``: transformers' (logits, KV or MLA rows), once each."""

    @cache
    def forward(source: str, key: str) -> tuple:
        model = hf_model(checkpoints[source][1])
        ids = getattr(PROMPTS, key)
        return hf_mla_forward(model, ids) if "deepseek" in source else hf_forward(model, ids)

    return forward


def results(out: Path, name: str) -> list[dict]:
    size = RUNS[name][1]
    return [torch.load(result_path(out, name, size, rank)) for rank in range(size)]


def layer_kv(per_rank: list[dict], key: str, layer: int, mla: bool) -> list[torch.Tensor]:
    """One layer's whole KV: the latent rows (the same on every rank), or K and V by heads."""
    if mla:
        rows = [r[f"{key}_kv"][layer][0][:, 0] for r in per_rank]
        assert all(torch.equal(rows[0], other) for other in rows[1:])
        return [rows[0]]
    planes = ([r[f"{key}_kv"][layer][i] for r in per_rank] for i in (0, 1))
    return [gather_kv_heads(plane, 2) for plane in planes]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("name", [n for n in RUNS if "_ep" in n])
def test_ep_matches_transformers_and_tp2(world, reference, name, key):
    source = RUNS[name][0]
    mla = "deepseek" in source
    hf_logits, hf_kv = reference(source, key)
    mine = results(world, name)
    tp2 = results(world, f"{source}_tp2") if not source.startswith("fp8") else None
    for result in mine:
        torch.testing.assert_close(result[f"{key}_logits"], hf_logits[-1], atol=TOL, rtol=0)
        if tp2 is not None:
            expected = tp2[0][f"{key}_logits"]
            torch.testing.assert_close(result[f"{key}_logits"], expected, atol=TOL, rtol=0)
    for layer, hf_layer in enumerate(hf_kv):
        whole = layer_kv(mine, key, layer, mla)
        hf_parts = [hf_layer] if mla else list(hf_layer)
        for got, want in zip(whole, hf_parts, strict=True):
            torch.testing.assert_close(got, want, atol=TOL, rtol=1e-5 if mla else 0)
        if tp2 is not None:
            for got, want in zip(whole, layer_kv(tp2, key, layer, mla), strict=True):
                torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_first_tokens_agree(world):
    """Greedy first tokens: EP at every size and placement, as at TP 2."""
    for source in ("qwen3_moe", "deepseek_v3"):
        runs = [n for n in RUNS if RUNS[n][0] == source]
        for key in KEYS:
            tokens = {n: int(results(world, n)[0][f"{key}_logits"].argmax()) for n in runs}
            assert len(set(tokens.values())) == 1, tokens


def test_ranks_with_different_token_counts_get_their_experts_sums(world):
    """The exchange alone, as attention-DP ranks will call it (``ep_exchange_ranks``): 5, 0,
    3 and 2 tokens on the four ranks, each token's sum as one process holding every expert
    computes it, the second call (the tokens reversed) too."""
    for rank, count in enumerate(TOKENS):
        for name, saved in torch.load(exchange_path(world, rank)).items():
            tol = 1e-5 if name == "fp32" else 0.05  # bf16: the sums in another order
            got, again, want = saved["got"].float(), saved["again"].float(), saved["want"].float()
            assert got.shape == (count, 16), name
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)
            torch.testing.assert_close(again, want.flip(0), atol=tol, rtol=tol, msg=name)
