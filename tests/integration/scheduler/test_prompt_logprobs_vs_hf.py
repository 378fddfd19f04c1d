"""Prompt logprobs (SGLang's ``logprob_start_len``) from the engine with the real runner (fp32,
tiny random checkpoints) against ``transformers``' log-softmax, within 1e-4: from position 0,
from inside a chunk, from a chunk boundary, from the last position and the end; chunked
prefill (chunk 8, page 4) with chunk boundaries inside the scored range; batches mixing
requests that ask with ones that do not; logits taken three rows at a time; and with the
prefix cache: a hit capped at the start, and prompts sharing a cached prefix. The first
token stays the reference's argmax, and every pool is whole afterwards."""

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
from tests.integration.scheduler.capture import RecordingRunner
from tests.unit.scheduler.fakes import FakeBackend

PAGE_SIZE, VOCAB = 4, 320
TOL = 1e-4
SHARED, TAIL = prompt(45, seed=31), prompt(15, seed=32)
# name: (tokens, logprob start (None: none asked), return_logprob)
MIXED = {
    "s0": (prompt(37, seed=33), 0, True),
    "s13": (prompt(37, seed=34), 13, True),  # inside chunk [8, 16), off a page boundary
    "plain": (prompt(30, seed=35), None, True),  # the first token's logprob only
    "s16": (prompt(29, seed=36), 16, True),  # a chunk boundary: position 16 scores token 17
    "off": (prompt(25, seed=37), None, False),
    "last": (prompt(20, seed=38), 19, True),  # only the sampled position: no prompt logprob
    "end": (prompt(20, seed=39), 20, True),
}
# name: (tokens, logprob start, the hit the cache gives), served one after the other
CACHED = {
    "warm": (SHARED, None, 0),  # stores 11 whole pages
    "capped": (SHARED, 10, 8),  # 44 tokens cached, but positions 10.. must be computed
    "shared": ([*SHARED[:30], *TAIL], 35, 28),  # its 7 cached pages end before the start
    "shared_early": ([*SHARED[:30], *TAIL], 6, 4),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(request.param, tmp_path_factory.mktemp("plp") / request.param)


class Served:
    """An engine over the real runner, its prefix cache on, and the outcomes."""

    def __init__(self, checkpoint: Path, overlap: bool) -> None:
        runner, kv_cache, _ = build(
            checkpoint, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=128
        )
        runner.model.logprob_block_bytes = 3 * VOCAB * 4  # three rows of logits at a time
        self.runner = RecordingRunner(runner)
        self.pool, self.aux = PagePool(kv_cache.layout.num_pages), AuxPool(4)
        self.backend = FakeBackend(self.pool, self.aux, auto_want=True, polls_to_success=1)
        self.outcomes: dict[str, Outcome] = {}
        self.engine = Engine(
            self.runner,
            self.backend,
            EngineKV(self.pool, self.aux, PagePrefixCache(self.pool, PAGE_SIZE)),
            lambda o: self.outcomes.__setitem__(o.request_id, o),
            EngineLimits(
                page_size=PAGE_SIZE,
                chunk_size=8,
                max_batch_tokens=24,
                max_running_requests=3,
                bootstrap_timeout_s=60.0,
                transfer_timeout_s=60.0,
            ),
            overlap=overlap,
        )

    def submit(self, name: str, ids: list[int], start: int | None, asks: bool = True) -> None:
        room = len(self.backend.senders) + 1
        msg = PrefillRequest(name, ids, SamplingParams(), asks, room, 0.0, None, None, start)
        self.engine.submit(msg)

    def run_until_idle(self) -> None:
        for _ in range(500):
            if not self.engine.step() and self.engine.load.num_live == 0:
                return
        raise AssertionError(f"not idle: {self.engine.load}")

    def close(self) -> None:
        self.engine.shutdown()
        self.engine.check_integrity()
        assert self.pool.num_free == self.pool.num_pages and self.aux.num_free == 4
        assert not any(s.errors for s in self.backend.all_senders)


def check(model: torch.nn.Module, out: Outcome, ids: list[int], start: int | None) -> None:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [n, vocab]
    assert out.reason is FinishReason.OK, out
    assert out.first_token_id == int(logits[-1].argmax()), out.request_id
    if start is None:
        assert out.prompt_logprobs is None, out.request_id
        return
    logprobs = torch.log_softmax(logits, dim=-1)
    ref = [float(logprobs[p, ids[p + 1]]) for p in range(start, len(ids) - 1)]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ref)
    torch.testing.assert_close(
        torch.tensor(out.prompt_logprobs), torch.tensor(ref), atol=TOL, rtol=0
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_match_transformers(checkpoint: Path, overlap: bool) -> None:
    model = hf_model(checkpoint)
    served = Served(checkpoint, overlap)
    for name, (ids, start, asks) in MIXED.items():  # all at once: mixed batches
        served.submit(name, ids, start, asks)
    served.run_until_idle()
    mixed = [{bool(c.logprob_token_ids) for c in p.chunks} for p in served.runner.plans]
    assert {True, False} in mixed  # a batch with both kinds of request
    for name, (ids, start, _) in CACHED.items():
        served.submit(name, ids, start)
        served.run_until_idle()
    served.close()
    for name, (ids, start, asks) in MIXED.items():
        check(model, served.outcomes[name], ids, start if asks else None)
    for name, (ids, start, hit) in CACHED.items():
        check(model, served.outcomes[name], ids, start)
        assert served.outcomes[name].num_prefix_hit_tokens == hit, name
