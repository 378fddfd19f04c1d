"""DeepSeek-V3's MTP draft (``model.draft.mtp``) against a reference written here from the
model's definition, over transformers' own ``DeepseekV3DecoderLayer`` for the inner layer.

transformers has no NextN module, so the checkpoint is made in two steps: a tiny random
3-layer DeepSeek-V3 (the target) and a 4-layer one whose layer 3 (an MLA + MoE layer,
per-expert tensors as DeepSeek ships them) becomes the target's ``model.layers.3.``, beside
random ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head`` tensors (and a target final
norm that is not all ones, so normed and un-normed target states differ); config.json says
``num_nextn_predict_layers: 1``. The reference runs the target in transformers, takes its
final (normed) hidden states, shifts the ids by one with the first sampled token last, and
runs enorm/hnorm/eh_proj, the 4-layer model's layer 3 (its cache: the draft KV), the shared
head's norm and head and a softmax top-k. fp32, 1e-4: the draft's pool rows, top-k
probabilities, top-k ids and last hidden state; for a prompt in one chunk and in two (the
second chunk reads the first's draft rows back from the draft pool).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prefill_worker.batch import ChunkPlan
from prefill_worker.model import build
from prefill_worker.model.draft.mtp import MTPDraft, load_mtp, shifted_ids
from prefill_worker.model.draft.runner import DraftingRunner
from prefill_worker.model.hf_config import CheckpointError, read_spec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.request import SamplingParams
from tests.checkpoints import MTP, make_checkpoint, with_mtp_layer
from tests.integration.model.conftest import NUM_PAGES, PAGE_SIZE, hf_model, ours, plan, prompt
from tests.integration.model.conftest import scattered_pages as pages_for

TOL = 1e-4
TOPK = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the target with its MTP layer, the 4-layer donor of that layer)."""
    root = tmp_path_factory.mktemp("mtp")
    return with_mtp_layer(root), root / "donor"


@pytest.fixture(scope="module")
def hf(checkpoints):  # type: ignore[no-untyped-def]
    target, donor = checkpoints
    return hf_model(target), hf_model(donor)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's RMSNorm, by its definition, in fp32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference(hf, tensors: dict[str, torch.Tensor], ids: list[int]):  # type: ignore[no-untyped-def]
    """(first token, top-k p [k], top-k ids [k], last hidden [hidden], draft pool rows
    [S, r + rope]) by the model's definition."""
    from transformers import DynamicCache

    target, donor = hf
    eps = target.config.rms_norm_eps
    with torch.no_grad():
        states = target.model(torch.tensor([ids])).last_hidden_state  # [1, S, hidden], normed
        first = int(target.lm_head(states[0, -1]).argmax())
        shifted = torch.tensor([[*ids[1:], first]])
        e = rms(target.model.embed_tokens(shifted), tensors[MTP + "enorm.weight"], eps)
        h = rms(states, tensors[MTP + "hnorm.weight"], eps)
        x = torch.cat([e, h], -1) @ tensors[MTP + "eh_proj.weight"].T
        positions = torch.arange(len(ids))[None]
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        cache = DynamicCache()
        y = donor.model.layers[3](
            x,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            position_embeddings=donor.model.rotary_emb(x, positions),
        )
        last = rms(y[0, -1], tensors[MTP + "shared_head.norm.weight"], eps)
        probs = torch.softmax(last @ tensors[MTP + "shared_head.head.weight"].T, -1)
        topk_p, topk_index = probs.topk(TOPK)
    layer = cache.layers[3]
    rope = layer.values[0, 0]  # transformers' order: rotated even elements, then odd ones
    half = rope.shape[-1] // 2
    interleaved = torch.stack([rope[:, :half], rope[:, half:]], -1).flatten(-2)
    return first, topk_p, topk_index, last, torch.cat([layer.keys[0, 0], interleaved], -1)


def ours_with_draft(path: Path):  # type: ignore[no-untyped-def]
    runner, kv_cache, _ = ours(path)
    model = runner.model
    weights = load_mtp(path, model.spec, torch.float32, torch.device("cpu"))
    draft = MTPDraft(model.spec, weights, model.weights.embed, TOPK, experts=model.experts)
    draft_kv = KVCache(dataclasses.replace(kv_cache.layout, num_layers=1), kv_cache.device)
    return runner, draft, draft_kv


def run_chunk(runner, draft, draft_kv, chunk: ChunkPlan, next_id: int | None, normed=True):  # type: ignore[no-untyped-def]
    """The target's forward, then the draft's over the same chunk; ``next_id`` None: the
    chunk ends the prompt and the draft's last token is the target's sampled one.
    ``normed`` False feeds the draft the target's residual before its final norm."""
    with torch.inference_mode():
        packed = runner.pack(plan(chunk))
        runner.attention.plan(packed.batch)
        out, residual = runner.model.forward_with_hidden(
            packed.inputs, runner.kv_cache, runner.attention
        )
        first = int(out.logits[0].argmax()) if next_id is None else next_id
        inputs = dataclasses.replace(
            packed.inputs,
            input_ids=shifted_ids(
                packed.inputs.input_ids,
                torch.tensor([chunk.num_tokens]),
                torch.tensor([first]),
            ),
            logits_rows=torch.tensor([chunk.num_tokens - 1]),
        )
        states = runner.model.final_norm(residual) if normed else residual
        proposal = draft.extend(inputs, states, draft_kv, runner.attention)
    return first, proposal


def pool_rows(kv_cache, pages: list[int], length: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.cat([kv_cache.k[0][p] for p in pages])[:length, 0]


def check(got, expected, pages, draft_kv, length):  # type: ignore[no-untyped-def]
    first, proposal = got
    ref_first, topk_p, topk_index, hidden, rows = expected
    assert first == ref_first
    assert proposal.topk_index[0].tolist() == topk_index.tolist()
    torch.testing.assert_close(proposal.topk_p[0], topk_p, atol=TOL, rtol=0)
    torch.testing.assert_close(proposal.hidden[0], hidden, atol=TOL, rtol=0)
    torch.testing.assert_close(pool_rows(draft_kv, pages, length), rows, atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def tensors(checkpoints) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return load_file(checkpoints[0] / "model.safetensors")


def test_one_chunk_equals_the_reference(checkpoints, hf, tensors):
    runner, draft, draft_kv = ours_with_draft(checkpoints[0])
    ids = prompt(70, seed=11)
    pages = pages_for(0, -(-len(ids) // PAGE_SIZE))
    whole = ChunkPlan("a", ids, 0, len(ids), pages, SamplingParams())
    got = run_chunk(runner, draft, draft_kv, whole, None)
    check(got, reference(hf, tensors, ids), pages, draft_kv, len(ids))
    assert got[1].topk_p[0, 0] > got[1].topk_p[0, -1] > 0


def test_two_chunks_equal_the_reference(checkpoints, hf, tensors):
    """The first chunk's last draft token is the prompt's next token; the second chunk's
    attention reads the first's rows from the draft pool."""
    runner, draft, draft_kv = ours_with_draft(checkpoints[0])
    ids = prompt(90, seed=12)
    pages = pages_for(1, -(-len(ids) // PAGE_SIZE))
    run_chunk(runner, draft, draft_kv, ChunkPlan("b", ids[:48], 0, 48, pages, None), ids[48])
    last = ChunkPlan("b", ids[48:], 48, len(ids), pages, SamplingParams())
    got = run_chunk(runner, draft, draft_kv, last, None)
    check(got, reference(hf, tensors, ids), pages, draft_kv, len(ids))


def test_pre_norm_target_states_differ(checkpoints, hf, tensors):
    """Guards the convention: the draft fed the target's residual before its final norm
    proposes a different hidden state, far beyond the tolerance."""
    runner, draft, draft_kv = ours_with_draft(checkpoints[0])
    ids = prompt(40, seed=13)
    pages = pages_for(2, -(-len(ids) // PAGE_SIZE))
    chunk = ChunkPlan("c", ids, 0, 40, pages, SamplingParams())
    got = run_chunk(runner, draft, draft_kv, chunk, None, normed=False)
    _, _, _, hidden, _ = reference(hf, tensors, ids)
    assert (got[1].hidden[0] - hidden).abs().max() > 100 * TOL


def test_a_checkpoint_without_an_mtp_layer_is_refused(checkpoints):
    _, donor = checkpoints
    spec = read_spec(donor)
    cpu = torch.device("cpu")
    with pytest.raises(CheckpointError, match="no MTP layer"):
        load_mtp(donor, dataclasses.replace(spec, num_nextn_layers=0), torch.float32, cpu)
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.enorm\.weight is missing"):
        load_mtp(donor, dataclasses.replace(spec, num_nextn_layers=1), torch.float32, cpu)


def build_drafting(path: Path, draft: str = "mtp"):  # type: ignore[no-untyped-def]
    return build(
        path, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES,
        draft=draft, draft_topk=TOPK,
    )  # fmt: skip


def test_the_runner_runs_the_draft_after_every_chunk(checkpoints, hf, tensors):
    """Through ``model.build(draft="mtp")``: two prompts in one batch, the second in two
    chunks (its first chunk names the prompt token after it); each sampled token carries
    the reference's proposal, the hidden state as the model's dtype's bytes."""
    runner, kv_cache, _ = build_drafting(checkpoints[0])
    assert isinstance(runner, DraftingRunner)
    a, b = prompt(50, seed=21), prompt(75, seed=22)
    pages_a, pages_b = pages_for(3, 4), pages_for(4, 5)
    first_b = ChunkPlan("b", b[:32], 0, 32, pages_b, None, next_token_id=b[32])
    runner.run(plan(first_b))
    out = runner.run(
        plan(
            ChunkPlan("a", a, 0, len(a), pages_a, SamplingParams()),
            ChunkPlan("b", b[32:], 32, len(b), pages_b, SamplingParams()),
        )
    )
    for sampled, ids, pages in zip(out.sampled, (a, b), (pages_a, pages_b), strict=True):
        first, topk_p, topk_index, hidden, rows = reference(hf, tensors, ids)
        assert sampled.token_id == first and sampled.draft is not None
        assert list(sampled.draft.topk_index) == topk_index.tolist()
        torch.testing.assert_close(torch.tensor(sampled.draft.topk_p), topk_p, atol=TOL, rtol=0)
        got = torch.frombuffer(bytearray(sampled.draft.hidden), dtype=torch.float32)
        torch.testing.assert_close(got, hidden, atol=TOL, rtol=0)
        torch.testing.assert_close(
            pool_rows(runner.draft_kv, pages, len(ids)), rows, atol=TOL, rtol=0
        )
    assert kv_cache is runner.kv_cache and runner.draft_kv.layout.num_layers == 1


def test_a_chunk_without_its_next_token_is_refused(checkpoints):
    runner, _, _ = build_drafting(checkpoints[0])
    ids = prompt(40, seed=23)
    with pytest.raises(ValueError, match="no next token for the draft"):
        runner.run(plan(ChunkPlan("c", ids[:16], 0, 16, pages_for(5, 3), None)))


def test_without_a_draft_nothing_changes(checkpoints):
    runner, _, _ = build_drafting(checkpoints[0], draft="none")
    assert not isinstance(runner, DraftingRunner)
    ids = prompt(20, seed=24)
    out = runner.run(plan(ChunkPlan("d", ids, 0, 20, pages_for(6, 2), SamplingParams())))
    assert out.sampled[0].draft is None


def test_a_draft_needs_deepseek_v3(tmp_path):
    llama = make_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="needs a DeepSeek-V3 model"):
        build_drafting(llama)
