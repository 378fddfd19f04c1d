"""EAGLE and EAGLE-3 drafts (``model.draft.eagle``) of a tiny random Llama against a reference
written here from the drafts' definition (SGLang 0.5.23's ``llama_eagle.py`` and
``llama_eagle3.py``), over transformers' Llama for the target.

The reference runs the target in transformers (its hidden states: the input of each layer,
and the final normed one), shifts the ids by one with the first sampled token last, and runs
the draft in plain torch: EAGLE's ``fc([embed | normed target state]) + bias``, one Llama layer
without an input norm, no final norm, the target's LM head; EAGLE-3's ``fc`` over the inputs
of target layers 1, 2, 3, ``[input_norm(embed) | hidden_norm(fc)]`` into attention, its own
norm and a 96-token LM head, the hidden row taken before that norm. fp32, 1e-4: the draft
pool's K and V, the top-k probabilities, ids and hidden state; two prompts in one batch, one
of them in two chunks (the second reads the first's draft K/V back from the pool).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from prefill_worker.batch import ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.draft.runner import DraftingRunner
from prefill_worker.model.hf_config import CheckpointError
from prefill_worker.request import SamplingParams
from tests.checkpoints import hf_model, prompt
from tests.eagle_checkpoints import DRAFT_VOCAB, LAYER, target_and_draft
from tests.integration.model.conftest import NUM_PAGES, PAGE_SIZE, paged_kv, plan
from tests.integration.model.conftest import scattered_pages as pages_for

TOL = 1e-4
TOPK = 4
EPS = 1e-6


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eagle")
    for kind in ("eagle", "eagle3"):
        target_and_draft(root, kind)
    return root


@pytest.fixture(scope="module")
def target(root: Path) -> torch.nn.Module:
    return hf_model(root / "target")


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """``x [S, heads, D]`` rotated by position (half-split, the draft's plain RoPE)."""
    d = x.shape[-1]
    angles = torch.arange(x.shape[0])[:, None] / theta ** (torch.arange(0, d, 2) / d)[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [S, 1, D/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def draft_layer(t: dict[str, torch.Tensor], p: str, x: torch.Tensor, r: torch.Tensor):  # type: ignore[no-untyped-def]
    """One Llama layer by definition: ``r`` + attention of ``x``, + MLP; (r, K, V)."""
    n = x.shape[0]
    q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(n, -1, 16))
    k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(n, -1, 16))
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, -1, 16)
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("shd,thd->hst", q, k.repeat_interleave(group, 1)) / math.sqrt(16)
    scores = scores + torch.full((n, n), float("-inf")).triu(1)
    attn = torch.einsum("hst,thd->shd", scores.softmax(-1), v.repeat_interleave(group, 1))
    r = r + attn.reshape(n, -1) @ t[p + "self_attn.o_proj.weight"].T
    h = rms(r, t[p + "post_attention_layernorm.weight"])
    mlp = F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)
    return r + mlp @ t[p + "mlp.down_proj.weight"].T, k, v


def reference(kind: str, target, t: dict[str, torch.Tensor], ids: list[int]):  # type: ignore[no-untyped-def]
    """(first token, top-k p [k], top-k ids [k], hidden [H], draft K [S, 2, 16], V)."""
    p = LAYER[kind]
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
        first = int(out.logits[0, -1].argmax())
        e = target.model.embed_tokens(torch.tensor([*ids[1:], first]))  # [S, H]
        if kind == "eagle3":
            states = torch.cat([out.hidden_states[i][0] for i in (1, 2, 3)], -1)  # [S, 3H]
            r = states @ t["fc.weight"].T
            x = torch.cat(
                [rms(e, t[p + "input_layernorm.weight"]), rms(r, t[p + "hidden_norm.weight"])], -1
            )
        else:
            normed = target.model(torch.tensor([ids])).last_hidden_state[0]  # [S, H]
            r = x = torch.cat([e, normed], -1) @ t["fc.weight"].T + t["fc.bias"]
        r, k, v = draft_layer(t, p, x, r)
        last = r[-1]
        if kind == "eagle3":
            logits = rms(last, t["norm.weight"]) @ t["lm_head.weight"].T
        else:
            logits = last @ target.lm_head.weight.T
        topk_p, topk_index = logits.softmax(-1).topk(TOPK)
    return first, topk_p, topk_index, last, k, v


def build_drafting(root: Path, kind: str, draft_path: Path | None = None):  # type: ignore[no-untyped-def]
    return build(
        root / "target", dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES,
        draft=kind, draft_topk=TOPK, draft_path=draft_path or root / kind,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_runner_proposes_the_references_draft(root, target, kind):
    """Through ``model.build(draft=kind)``: prompt a whole, prompt b in two chunks (its first
    names the prompt token after it); each sampled token carries the reference's proposal,
    the draft pool holds the reference's K and V at the prompt's pages."""
    runner, kv_cache, _ = build_drafting(root, kind)
    assert isinstance(runner, DraftingRunner) and runner.draft_kv.layout.num_layers == 1
    tensors = load_file(root / kind / "model.safetensors")
    a, b = prompt(50, seed=31), prompt(75, seed=32)
    pages_a, pages_b = pages_for(0, 4), pages_for(1, 5)
    runner.run(plan(ChunkPlan("b", b[:32], 0, 32, pages_b, None, next_token_id=b[32])))
    out = runner.run(
        plan(
            ChunkPlan("a", a, 0, len(a), pages_a, SamplingParams()),
            ChunkPlan("b", b[32:], 32, len(b), pages_b, SamplingParams()),
        )
    )
    for sampled, ids, pages in zip(out.sampled, (a, b), (pages_a, pages_b), strict=True):
        first, topk_p, topk_index, hidden, k, v = reference(kind, target, tensors, ids)
        assert sampled.token_id == first and sampled.draft is not None
        assert list(sampled.draft.topk_index) == topk_index.tolist()
        torch.testing.assert_close(torch.tensor(sampled.draft.topk_p), topk_p, atol=TOL, rtol=0)
        got = torch.frombuffer(bytearray(sampled.draft.hidden), dtype=torch.float32)
        torch.testing.assert_close(got, hidden, atol=TOL, rtol=0)
        got_k, got_v = paged_kv(runner.draft_kv, pages, len(ids), 0)
        torch.testing.assert_close(got_k, k, atol=TOL, rtol=0)
        torch.testing.assert_close(got_v, v, atol=TOL, rtol=0)
    if kind == "eagle3":  # draft ids: the decode maps them to target ids (d2t) itself
        assert all(0 <= i < DRAFT_VOCAB for s in out.sampled for i in s.draft.topk_index)
    assert kv_cache is runner.kv_cache


def test_a_draft_that_does_not_fit_is_refused(root, tmp_path):
    with pytest.raises(ValueError, match="needs the draft checkpoint's path"):
        build(root / "target", device="cpu", num_pages=8, draft="eagle3")
    _, other = target_and_draft(tmp_path, "eagle3")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 4}))
    with pytest.raises(ValueError, match="are not the target's"):
        build_drafting(root, "eagle3", other)
    (other / "config.json").write_text(json.dumps(config))
    tensors = load_file(other / "model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, other / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"midlayer\.hidden_norm\.weight is missing"):
        build_drafting(root, "eagle3", other)
