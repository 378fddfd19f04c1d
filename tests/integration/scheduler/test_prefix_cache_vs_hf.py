"""The prefix cache with the real model runner (fp32, tiny random checkpoints) against
``transformers``: with the cache off, with a partial hit, with whole-prompt hits (the last
token, or the last page, is computed again) and with a hit on pages that a running request is
still filling, the first token is the reference's argmax and every page handed to the sender
(copied at that moment: what NIXL reads) holds the reference K/V within 1e-4 (DeepSeek-V3:
the MLA latent rows transformers' cache implies; gpt-oss, window 24: a sliding layer's last 23
positions, what transformers keeps, so a hit's pages hold what a later chunk's window reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.model import build
from prefill_worker.request import FinishReason, Outcome, PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.model.conftest import hf_mla_forward
from tests.integration.scheduler.capture import CapturingBackend

PAGE_SIZE = 4
TOL = 1e-4
A = prompt(45, seed=21)
E = prompt(80, seed=22)
PROMPTS = {  # name: (tokens, tokens its hit must be with the cache on; None: see the test)
    "cold": (A, 0),
    "partial": ([*A[:26], *prompt(19, seed=23)], 24),
    "whole_aligned": (A[:44], 40),  # all 11 pages cached: the last page is computed again
    "whole_ragged": (A, 44),  # every full page cached: only the last token is computed
    "filling": (E, 0),
    "on_filling": ([*E[:60], *prompt(7, seed=24)], None),  # arrives while `filling` runs
}


@pytest.fixture(scope="module", params=["llama", "qwen3", "deepseek_v3", "gpt_oss"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(request.param, tmp_path_factory.mktemp("pfx") / request.param)


def submit(engine: Engine, name: str) -> None:
    room = list(PROMPTS).index(name) + 1
    engine.submit(PrefillRequest(name, PROMPTS[name][0], SamplingParams(), True, room, 0.0))


def run_until_idle(engine: Engine) -> None:
    for _ in range(500):
        if not engine.step() and engine.load.num_live == 0:
            return
    raise AssertionError(f"not idle: {engine.load}")


def serve(checkpoint: Path, prefix_cache: bool, overlap: bool):  # type: ignore[no-untyped-def]
    runner, kv_cache, _ = build(
        checkpoint, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=96
    )
    pool, aux = PagePool(kv_cache.layout.num_pages), AuxPool(4)
    backend = CapturingBackend(pool, aux, auto_want=True, polls_to_success=1)
    backend.kv_cache = kv_cache
    outcomes: list[Outcome] = []
    engine = Engine(
        runner,
        backend,
        EngineKV(pool, aux, PagePrefixCache(pool, PAGE_SIZE) if prefix_cache else None),
        outcomes.append,
        EngineLimits(
            page_size=PAGE_SIZE,
            chunk_size=8,
            max_batch_tokens=16,
            max_running_requests=3,
            bootstrap_timeout_s=60.0,
            transfer_timeout_s=60.0,
        ),
        overlap=overlap,
    )
    for name in ("cold", "partial", "whole_aligned", "whole_ragged"):
        submit(engine, name)
        run_until_idle(engine)
    submit(engine, "filling")
    for _ in range(3):  # 3 turns: its first chunks are done, most of its pages are not
        engine.step()
    submit(engine, "on_filling")
    run_until_idle(engine)
    engine.shutdown()
    engine.check_integrity()
    assert pool.num_free == pool.num_pages and not any(s.errors for s in backend.all_senders)
    return {o.request_id: o for o in outcomes}, backend


def check_against_hf(model, name: str, out: Outcome, captured: dict) -> None:  # type: ignore[no-untyped-def]
    ids = PROMPTS[name][0]
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=True)
    assert out.reason is FinishReason.OK, out
    assert out.first_token_id == int(ref.logits[0, -1].argmax()), name
    assert sorted(captured) == list(range(-(-len(ids) // PAGE_SIZE))), name  # every page, once
    if model.config.model_type == "deepseek_v3":  # an MLA pool: one latent row per token
        _, rows = hf_mla_forward(model, ids)
        for layer, expected in enumerate(rows):
            got = torch.cat([captured[p][0][layer] for p in sorted(captured)])[: len(ids), 0]
            torch.testing.assert_close(got, expected, atol=TOL, rtol=1e-5)
        return
    for layer, cache in enumerate(ref.past_key_values.layers):
        for index, expected in ((0, cache.keys), (1, cache.values)):
            got = torch.cat([captured[p][index][layer] for p in sorted(captured)])[: len(ids)]
            kept = expected[0].transpose(0, 1)  # a sliding layer: its last window - 1 only
            torch.testing.assert_close(got[-kept.shape[0] :], kept, atol=TOL, rtol=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_first_token_and_every_page_match_transformers(checkpoint: Path, overlap: bool) -> None:
    if checkpoint.name in ("deepseek_v3", "gpt_oss") and not overlap:
        pytest.skip("MLA and gpt-oss run the daemon's default (overlap) only, to keep CI lean")
    model = hf_model(checkpoint)
    for prefix_cache in (False, True):
        outcomes, backend = serve(checkpoint, prefix_cache, overlap)
        for name, (ids, hit) in PROMPTS.items():
            out = outcomes[name]
            check_against_hf(model, name, out, backend.senders[name].captured)
            assert out.num_prefix_hit_tokens + out.num_computed_tokens == len(ids)
            if not prefix_cache:
                assert out.num_prefix_hit_tokens == 0, name
            elif hit is not None:
                assert out.num_prefix_hit_tokens == hit, name
        if prefix_cache:  # only the pages `filling` had finished: more than none, not all 15
            assert 0 < outcomes["on_filling"].num_prefix_hit_tokens < 60
