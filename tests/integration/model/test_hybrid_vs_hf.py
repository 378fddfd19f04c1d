"""Qwen3-Next (MoE) and Qwen3.5 (dense), hybrids of gated DeltaNet and gated full attention,
through our runner against ``transformers``.

Tiny random fp32 checkpoints (``tests/checkpoints.py``: 5 layers in the order linear, full,
linear, linear, full; 3 value heads per key head; head dims 12/10; a quarter of each attention
head rotated; the ``1 + weight`` norms randomised). For a batch of two prompts, a prompt in
two chunks (the state carried in its slot from one to the next), a prompt shorter than the
conv window, and a slot reused by a second request: the last token's logits and the prompt
logprobs, every full layer's K/V in the pool, and every linear layer's conv and recurrent
state in the request's slot equal transformers' within 1e-4. transformers' conv state keeps
the last ``kernel`` inputs; a slot keeps the last ``kernel - 1`` (all the next token reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.batch import ChunkPlan
from prefill_worker.model.moe.block import MoEWeights
from prefill_worker.model.runner import Runner
from prefill_worker.request import SamplingParams
from tests.checkpoints import HYBRID_FAMILIES, make_checkpoint
from tests.integration.model.conftest import (
    PAGE_SIZE,
    hf_model,
    ours,
    paged_kv,
    plan,
    prompt,
    scattered_pages,
)

TOL = 1e-4
FULL_LAYERS, LINEAR_LAYERS = (1, 4), (0, 2, 3)


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


@pytest.fixture(scope="module")
def hf(checkpoint):  # type: ignore[no-untyped-def]
    return hf_model(checkpoint)


def hf_forward(model, ids: list[int]):  # type: ignore[no-untyped-def]
    """(logits [S, vocab], {full layer: (k, v) [S, KV, D]}, {linear layer: (conv [C, K-1],
    recurrent [Hv, Dk, Dv])})."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    layers = out.past_key_values.layers
    kv = {
        i: (layers[i].keys[0].transpose(0, 1), layers[i].values[0].transpose(0, 1))
        for i in FULL_LAYERS
    }
    state = {
        i: (layers[i].conv_states[0][0, :, 1:], layers[i].recurrent_states[0][0])
        for i in LINEAR_LAYERS
    }
    return out.logits[0].float(), kv, state


def num_pages(length: int) -> int:
    return -(-length // PAGE_SIZE)


def prompt_logprobs(logits: torch.Tensor, ids: list[int], start: int) -> torch.Tensor:
    return logits[start:-1].log_softmax(-1).gather(1, torch.tensor(ids[start + 1 :])[:, None])[:, 0]


def assert_matches(runner: Runner, pages: list[int], slot: int, ids: list[int], hf) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The pool's K/V and the slot's state equal transformers' for ``ids``; its logits."""
    logits, kv, state = hf_forward(hf, ids)
    kv_cache, states = runner.kv_cache, runner.model.state  # type: ignore[union-attr]
    for pool_layer, layer in enumerate(FULL_LAYERS):
        k, v = paged_kv(kv_cache, pages, len(ids), pool_layer)
        torch.testing.assert_close(k, kv[layer][0], atol=TOL, rtol=1e-5)
        torch.testing.assert_close(v, kv[layer][1], atol=TOL, rtol=1e-5)
    for slot_layer, layer in enumerate(LINEAR_LAYERS):
        torch.testing.assert_close(
            states.conv[slot_layer][slot], state[layer][0], atol=TOL, rtol=1e-5
        )
        torch.testing.assert_close(
            states.recurrent[slot_layer][slot], state[layer][1], atol=TOL, rtol=1e-5
        )
    return logits


def whole(request_id: str, ids: list[int], pages: list[int], slot: int) -> ChunkPlan:
    return ChunkPlan(
        request_id, ids, 0, len(ids), pages, SamplingParams(), 0, tuple(ids[1:]), state_slot=slot
    )  # fmt: skip


def test_a_batch_of_two_prompts(checkpoint, hf):
    runner, kv_cache, info = ours(checkpoint)
    assert (kv_cache.layout.num_layers, info.num_layers) == (len(FULL_LAYERS), 5)
    prompts = [prompt(100, seed=3), prompt(37, seed=4)]  # 100: two blocks of the delta rule
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    slots = [5, 2]
    chunks = (whole(f"r{i}", p, pages[i], slots[i]) for i, p in enumerate(prompts))
    out = runner.run(plan(*chunks))
    for i, ids in enumerate(prompts):
        logits = assert_matches(runner, pages[i], slots[i], ids, hf)
        assert out.sampled[i].token_id == int(logits[-1].argmax())
        expected = float(logits[-1].log_softmax(-1).max())
        assert out.sampled[i].logprob == pytest.approx(expected, abs=TOL)
        torch.testing.assert_close(
            torch.tensor(out.prompt_logprobs[i].logprobs),
            prompt_logprobs(logits, ids, 0),
            atol=TOL,
            rtol=0,
        )


def test_two_chunks_carry_the_state(checkpoint, hf):
    """The second chunk starts from the first's conv window and recurrent state."""
    runner, _, _ = ours(checkpoint)
    ids = prompt(150, seed=5)
    pages = scattered_pages(0, num_pages(len(ids)))
    runner.run(plan(ChunkPlan("a", ids[:80], 0, 80, pages, None, state_slot=3)))
    sampling = SamplingParams()
    last = ChunkPlan("a", ids[80:], 80, 150, pages, sampling, 80, tuple(ids[81:]), state_slot=3)
    out = runner.run(plan(last))
    logits = assert_matches(runner, pages, 3, ids, hf)
    assert out.sampled[0].token_id == int(logits[-1].argmax())
    expected = prompt_logprobs(logits, ids, 80)
    got = torch.tensor(out.prompt_logprobs[0].logprobs)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_a_reused_slot_starts_from_zero_and_a_short_prompt(checkpoint, hf):
    """A slot left holding one request's state serves the next from scratch; a prompt of 2
    tokens (shorter than the conv window) leaves zeros before its inputs."""
    runner, _, _ = ours(checkpoint)
    first, short = prompt(60, seed=6), prompt(2, seed=7)
    runner.run(plan(whole("a", first, scattered_pages(0, 4), 0)))
    pages = scattered_pages(1, 1)
    logits = runner.compute_logits(plan(whole("b", short, pages, 0)))
    hf_logits = assert_matches(runner, pages, 0, short, hf)
    torch.testing.assert_close(logits[0], hf_logits[-1], atol=TOL, rtol=0)


def test_a_chunk_without_a_slot_is_refused(checkpoint):
    runner, _, _ = ours(checkpoint)
    ids = prompt(10, seed=8)
    with pytest.raises(ValueError, match="bad state slot None"):
        runner.run(plan(ChunkPlan("a", ids, 0, 10, [0], SamplingParams())))
    twice = [whole("a", ids, [0], 1), whole("b", ids, [1], 1)]
    with pytest.raises(ValueError, match="bad state slot 1"):
        runner.run(plan(*twice))


def test_the_moe_layers_route_and_the_shared_expert_is_gated(checkpoint, hf):
    """The MoE families (Qwen3-Next: layer 2 dense; Qwen3.5-MoE: every layer sparse): zeroing
    the shared expert's gate weights (sigmoid 0.5, not 1) moves
    the logits by over 20 times the tolerance, so the comparisons above check the gate."""
    runner, _, _ = ours(checkpoint)
    sparse = [
        layer.mlp for layer in runner.model.weights.layers if isinstance(layer.mlp, MoEWeights)
    ]  # type: ignore[union-attr]
    expected = {"qwen3_next": 4, "qwen3_5_moe": 5, "qwen3_5": 0}[runner.model.spec.family]
    assert len(sparse) == expected and all(m.shared_gate is not None for m in sparse)
    if not sparse:
        return
    ids = prompt(40, seed=9)
    logits, _, _ = hf_forward(hf, ids)
    for mlp in sparse:
        mlp.shared_gate.zero_()  # type: ignore[union-attr]
    got = runner.compute_logits(plan(whole("a", ids, scattered_pages(0, 3), 0)))
    assert (got[0] - logits[-1]).abs().max() > 20 * TOL


def test_a_tp_size_that_does_not_split_the_key_heads_is_refused_at_start(checkpoint):
    """2 linear key heads split over 2 ranks (tests/integration/model/test_tensor_parallel.py
    runs it), not over 4."""
    from prefill_worker.model.parallel import TPGroup

    with pytest.raises(ValueError, match="2 linear-attention key heads do not split over 4"):
        ours(checkpoint, tp=TPGroup(rank=0, size=4, group=None))


def test_a_tp_group_serves_its_state_over_every_protocol(checkpoint):
    """At TP 2 the group's leader gathers whole state slots (``model.state_gather``), which
    its native, SGLang and vLLM backends all send (tests/integration/daemon/
    test_hybrid_daemon.py, tests/interop/test_mamba_worker.py and test_vllm_worker_tp.py serve
    it at TP 2), so ``check_group_transfer`` refuses none of them."""
    from prefill_worker.model.hf_config import read_spec
    from prefill_worker.service.group_startup import check_group_transfer

    spec = read_spec(checkpoint)
    for protocol in ("native", "sglang", "vllm"):
        check_group_transfer(spec, 2, (protocol,))


def test_the_daemon_loads_it_with_one_state_slot_per_aux_row(checkpoint):
    """The daemon's model step sizes the state pool by ``cache.num_aux_rows`` and says what a
    decode needs beside the KV list (the transfer refuses it: tests/integration/daemon)."""
    from prefill_worker.kv.state_layout import LINEAR_STATE
    from prefill_worker.model import build
    from prefill_worker.service.config import load_config
    from prefill_worker.service.startup import load_model

    root = Path(__file__).resolve().parents[3]
    overrides = [f"model.path={checkpoint}", "cache.num_pages=8", "cache.num_aux_rows=3"]
    config = load_config(root / "configs" / "tiny-test.yaml", env={}, overrides=overrides)
    runner, kv_cache, info = load_model(config, build)
    assert info.state is not None
    assert (info.state.kind, info.state.layer_ids, info.state.num_items) == (
        LINEAR_STATE, LINEAR_LAYERS, 3
    )  # fmt: skip
    assert [t.name for t in info.state.tensors] == ["conv", "recurrent"]
    assert runner.model.state.num_slots == 3 and kv_cache.layout.num_layers == 2  # type: ignore[union-attr]
