"""gpt-oss through our runner against ``transformers`` (its eager attention: sinks, sliding
mask), on a tiny random fp32 checkpoint (``tests/checkpoints.py``: layers sliding, full,
sliding with a window of 24; 6 heads of 12 over 2 KV heads in a hidden of 96; 5 experts,
top 2, the SwiGLU clamp at 1; YaRN untruncated; sinks and router spread wide).

Prompts are longer than the window: a batch of two, a prompt in three chunks whose
boundaries fall inside pages (a later chunk's window reaches into the earlier chunks' pages),
and the same checkpoint with its experts shipped as MXFP4. The last token's logits, the
prompt logprobs, every full layer's K/V at every position and every sliding layer's K/V
over the positions transformers' sliding cache keeps (the last ``window - 1``: all a decode
reads) equal transformers' within 1e-4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from prefill_worker.batch import ChunkPlan
from prefill_worker.request import SamplingParams
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.model.conftest import (
    PAGE_SIZE,
    hf_forward,
    ours,
    paged_kv,
    plan,
    scattered_pages,
)
from tests.mxfp4_checkpoints import quantized

TOL = 1e-4
WINDOW = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "ckpt")


@pytest.fixture(scope="module")
def hf(checkpoint):  # type: ignore[no-untyped-def]
    return hf_model(checkpoint)


def num_pages(length: int) -> int:
    return -(-length // PAGE_SIZE)


def whole(request_id: str, ids: list[int], pages: list[int]) -> ChunkPlan:
    sampling = SamplingParams()
    return ChunkPlan(request_id, ids, 0, len(ids), pages, sampling, 0, tuple(ids[1:]))


def assert_matches(kv_cache, pages: list[int], ids: list[int], hf, full=(1,)) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Every layer's K/V in the pool equals transformers' where it keeps them (``full``:
    the full layers, every position; a sliding layer's cache keeps its last ``window - 1``);
    its logits."""
    logits, kv = hf_forward(hf, ids)
    kept = [k.shape[0] for k, _ in kv]
    window_kept = min(len(ids), WINDOW - 1)
    assert kept == [len(ids) if i in full else window_kept for i in range(len(kv))]
    for layer, (k_ref, v_ref) in enumerate(kv):
        k, v = paged_kv(kv_cache, pages, len(ids), layer)
        torch.testing.assert_close(k[-k_ref.shape[0] :], k_ref, atol=TOL, rtol=1e-5)
        torch.testing.assert_close(v[-v_ref.shape[0] :], v_ref, atol=TOL, rtol=1e-5)
    return logits


def logprobs_of(logits: torch.Tensor, ids: list[int], start: int) -> torch.Tensor:
    return logits[start:-1].log_softmax(-1).gather(1, torch.tensor(ids[start + 1 :])[:, None])[:, 0]


def test_a_batch_of_two_prompts(checkpoint, hf):
    runner, kv_cache, info = ours(checkpoint)
    assert (info.architecture, info.attention_backend, kv_cache.layout.num_layers) == (
        "GptOssForCausalLM", "sinks", 3
    )  # fmt: skip
    prompts = [prompt(100, seed=3), prompt(37, seed=4)]
    pages = [scattered_pages(i, num_pages(len(p))) for i, p in enumerate(prompts)]
    out = runner.run(plan(*(whole(f"r{i}", p, pages[i]) for i, p in enumerate(prompts))))
    for i, ids in enumerate(prompts):
        logits = assert_matches(kv_cache, pages[i], ids, hf)
        assert out.sampled[i].token_id == int(logits[-1].argmax())
        expected = float(logits[-1].log_softmax(-1).max())
        assert out.sampled[i].logprob == pytest.approx(expected, abs=TOL)
        got = torch.tensor(out.prompt_logprobs[i].logprobs)
        torch.testing.assert_close(got, logprobs_of(logits, ids, 0), atol=TOL, rtol=0)


def test_three_chunks_read_the_window_from_earlier_pages(checkpoint, hf):
    runner, kv_cache, _ = ours(checkpoint)
    ids = prompt(150, seed=5)
    pages = scattered_pages(0, num_pages(len(ids)))
    runner.run(plan(ChunkPlan("a", ids[:40], 0, 40, pages, None)))
    runner.run(plan(ChunkPlan("a", ids[40:90], 40, 90, pages, None)))
    last = ChunkPlan("a", ids[90:], 90, 150, pages, SamplingParams(), 90, tuple(ids[91:]))
    out = runner.run(plan(last))
    logits = assert_matches(kv_cache, pages, ids, hf)
    assert out.sampled[0].token_id == int(logits[-1].argmax())
    got = torch.tensor(out.prompt_logprobs[0].logprobs)
    torch.testing.assert_close(got, logprobs_of(logits, ids, 90), atol=TOL, rtol=0)


def test_a_long_prompt_in_query_blocks(checkpoint, hf):
    """Query blocks smaller than the prompt (each reading only its window's keys; a full
    layer's smaller still, its scores bounded) give the same logits as one block."""
    runner, kv_cache, _ = ours(checkpoint)
    runner.attention.block_queries = 16  # type: ignore[attr-defined]
    runner.attention.score_bytes = 4 * 6 * 91 * 5  # a full layer: blocks of 5 queries
    ids = prompt(90, seed=6)
    pages = scattered_pages(2, num_pages(len(ids)))
    logits = runner.compute_logits(plan(whole("a", ids, pages)))
    expected = assert_matches(kv_cache, pages, ids, hf)[-1]
    torch.testing.assert_close(logits[0], expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("change", ["no sinks", "no window", "no clamp", "no router bias"])
def test_each_part_moves_the_logits(checkpoint, hf, change):
    """Each of sinks, window, clamp and router bias changes the last logits by over 20
    times the tolerance, so the comparisons above check it."""
    runner, _, _ = ours(checkpoint)
    model = runner.model
    if change == "no sinks":
        for layer in model.weights.layers:  # type: ignore[union-attr]
            layer.sinks.fill_(-1e9)
    elif change == "no window":
        model.sliding = dataclasses.replace(model.sliding, window=10_000)  # type: ignore[union-attr]
    elif change == "no clamp":
        model.sliding = dataclasses.replace(model.sliding, swiglu_limit=1e9)  # type: ignore[union-attr]
    else:
        for layer in model.weights.layers:  # type: ignore[union-attr]
            layer.experts.router_bias.zero_()
    ids = prompt(100, seed=3)
    logits, _ = hf_forward(hf, ids)
    got = runner.compute_logits(plan(whole("a", ids, scattered_pages(0, num_pages(100)))))
    assert (got[0] - logits[-1]).abs().max() > 20 * TOL


def test_mxfp4_experts_are_dequantized_as_transformers_does(checkpoint, tmp_path):
    packed, reference = quantized(checkpoint, tmp_path)
    hf = hf_model(reference)
    runner, kv_cache, _ = ours(packed)
    ids = prompt(70, seed=7)
    pages = scattered_pages(0, num_pages(len(ids)))
    logits = runner.compute_logits(plan(whole("a", ids, pages)))
    expected = assert_matches(kv_cache, pages, ids, hf)[-1]
    torch.testing.assert_close(logits[0], expected, atol=TOL, rtol=0)
    original, _ = hf_forward(hf_model(checkpoint), ids)
    assert (original[-1] - logits[0]).abs().max() > 20 * TOL  # the quantization is real


@pytest.mark.parametrize("form", ["unquantized", "mxfp4"])
def test_a_tp_rank_loads_its_heads_sinks_and_expert_slices(checkpoint, tmp_path, form):
    """Rank 1 of 2 (no process group: loading has no collective) holds its 3 query heads'
    sinks and every expert's second half of the intermediate dimension, gate/up pairs and
    biases kept together, read from either form of the experts (MXFP4: whole 32-value groups
    of the down projection); the down bias and router whole. The logits at TP 2:
    tests/integration/model/test_tensor_parallel.py. 6 heads do not split over 4."""
    from prefill_worker.model.loader import load_checkpoint
    from prefill_worker.model.parallel import TPGroup

    path = checkpoint if form == "unquantized" else quantized(checkpoint, tmp_path)[0]
    cpu = torch.device("cpu")
    _, whole_model = load_checkpoint(path, torch.float32, cpu, None, TPGroup())
    _, part = load_checkpoint(path, torch.float32, cpu, None, TPGroup(1, 2))
    for full, mine in zip(whole_model.layers, part.layers, strict=True):  # type: ignore[union-attr]
        assert torch.equal(mine.sinks, full.sinks[3:])
        e, f = mine.experts, full.experts
        gate, up = f.gate_up.chunk(2, dim=1)  # [E, I, hidden] each
        assert torch.equal(e.gate_up, torch.cat([gate[:, 32:], up[:, 32:]], dim=1))
        bias_gate, bias_up = f.gate_up_bias.chunk(2, dim=1)
        assert torch.equal(e.gate_up_bias, torch.cat([bias_gate[:, 32:], bias_up[:, 32:]], 1))
        assert torch.equal(e.down, f.down[:, :, 32:])
        assert torch.equal(e.down_bias, f.down_bias) and torch.equal(e.router, f.router)
    with pytest.raises(ValueError, match="6 attention heads do not split over 4"):
        ours(checkpoint, tp=TPGroup(rank=0, size=4, group=None))


def bf16_within_hf_error(checkpoint: Path, hf) -> None:  # type: ignore[no-untyped-def]
    """Ours in bf16 is no further from transformers' fp32 logits than twice transformers' own
    bf16 run is (plus 1e-3)."""
    runner, _, _ = ours(checkpoint, dtype="bfloat16")
    ids = prompt(100, seed=3)
    got = runner.compute_logits(plan(whole("a", ids, scattered_pages(0, num_pages(100)))))
    reference, _ = hf_forward(hf, ids)
    own, _ = hf_forward(hf_model(checkpoint, torch.bfloat16), ids)
    hf_error = (own[-1] - reference[-1]).abs().max()
    assert (got[0].float() - reference[-1]).abs().max() <= 2 * hf_error + 1e-3


def test_bf16_is_within_transformers_own_bf16_error(checkpoint, hf):
    bf16_within_hf_error(checkpoint, hf)


def test_a_tp_group_serves_every_protocol(checkpoint):
    """At TP 2 the native protocol sends head slices of every page (as for a dense model),
    vLLM's decodes read every rank's heads from the shared staging region, and SGLang's get
    every rank's heads of each page (into a hybrid SWA pool, of the full layers' pages and
    of the window's): none is refused at start."""
    from prefill_worker.model.hf_config import read_spec
    from prefill_worker.service.group_startup import check_group_transfer

    spec = read_spec(checkpoint)
    for protocol in ("native", "vllm", "sglang"):
        check_group_transfer(spec, 2, (protocol,))


def test_a_refused_tp_group_stops_before_any_rank_starts(checkpoint, tmp_path):
    """The daemon's TP start-up refuses a model that does not split (here gpt-oss's 6
    attention heads over 4 ranks) as a configuration error (exit 78) before it starts a
    follower (the rank command here would leave a file behind if it ran)."""
    from prefill_worker.service.config import load_config
    from prefill_worker.service.group_startup import start_tp_group
    from prefill_worker.service.startup import StartupError
    from prefill_worker.tp.group import Placement

    root = Path(__file__).resolve().parents[3]
    overrides = [f"model.path={checkpoint}", "cache.num_pages=8", "transfer.protocol=sglang"]
    config = load_config(root / "configs" / "tiny-test.yaml", env={}, overrides=overrides)
    started = tmp_path / "started"
    command = ["sh", "-c", f"touch {started}"]
    with pytest.raises(StartupError, match="6 attention heads do not split over 4") as caught:
        start_tp_group(config, Placement(0, 4, 0, 0, False), command, lambda: None, b"")
    assert caught.value.exit_code == 78 and caught.value.step == "tp group"
    assert not started.exists()
