"""The real overlap strategy (forward on an executor thread) against serial, with the real
model runner on a tiny random Llama checkpoint: same plans, same first tokens, and the same
K/V in every page handed to the sender — captured when ``send_pages`` is called, i.e. while
the next forward may already be running. Serial is also checked against Hugging Face.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.batch import BatchPlan
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.model import build
from prefill_worker.request import FinishReason, PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.scheduler.capture import CapturingBackend, RecordingRunner

PAGE_SIZE = 4
LENGTHS = (5, 13, 30, 9, 21, 17)  # several chunks each at chunk_size 8; mixed batches


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("sched") / "llama")


def serve(checkpoint: Path, overlap: bool) -> tuple[dict, CapturingBackend, list]:
    runner, kv_cache, _ = build(
        checkpoint, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=48
    )
    pool, aux = PagePool(kv_cache.layout.num_pages), AuxPool(4)
    backend = CapturingBackend(pool, aux, auto_want=True, polls_to_success=1)
    backend.kv_cache = kv_cache
    outcomes: list = []
    recording = RecordingRunner(runner)
    engine = Engine(
        recording,
        backend,
        EngineKV(pool, aux),
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
    for i, length in enumerate(LENGTHS):
        sampling = SamplingParams(temperature=0.7, seed=5) if i == 2 else SamplingParams()
        engine.submit(PrefillRequest(f"r{i}", prompt(length, i), sampling, True, i + 1, 0.0))
    for _ in range(200):
        if not engine.step() and engine.load.num_live == 0:
            break
    engine.shutdown()
    engine.check_integrity()
    assert pool.num_free == pool.num_pages and not any(s.errors for s in backend.all_senders)
    return {o.request_id: o for o in outcomes}, backend, recording.plans


def spans(plans: list[BatchPlan]) -> list[list[tuple[str, int, int]]]:
    return [[(c.request_id, c.start, c.end) for c in plan.chunks] for plan in plans]


def test_overlapped_matches_serial_tokens_and_kv(checkpoint: Path) -> None:
    serial, serial_backend, serial_plans = serve(checkpoint, overlap=False)
    overlapped, overlapped_backend, overlapped_plans = serve(checkpoint, overlap=True)
    assert spans(serial_plans) == spans(overlapped_plans)
    assert any(len(p.chunks) > 1 for p in serial_plans) and len(serial_plans) > len(LENGTHS)
    assert set(serial) == set(overlapped) == {f"r{i}" for i in range(len(LENGTHS))}
    for request_id, out in serial.items():
        assert out.reason is FinishReason.OK
        assert overlapped[request_id].first_token_id == out.first_token_id
        a = serial_backend.senders[request_id].captured
        b = overlapped_backend.senders[request_id].captured
        assert sorted(a) == sorted(b) == list(range(-(-out.num_prompt_tokens // PAGE_SIZE)))
        for page in a:
            for x, y in zip(a[page], b[page], strict=True):
                # Bit-identical when the machine is quiet; under load MKL may pick another
                # thread split for a GEMM (MKL_DYNAMIC), which moves fp32 K/V by ~2e-6.
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_serial_kv_and_greedy_token_match_hugging_face(checkpoint: Path) -> None:
    outcomes, backend, _ = serve(checkpoint, overlap=False)
    model = hf_model(checkpoint)
    request_id, length = "r4", LENGTHS[4]
    ids = prompt(length, 4)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    assert outcomes[request_id].first_token_id == int(out.logits[0, -1].argmax())
    captured = backend.senders[request_id].captured
    for layer, cache in enumerate(out.past_key_values.layers):
        k_ref = cache.keys[0].transpose(0, 1)  # [S, KV, D]
        k = torch.cat([captured[p][0][layer] for p in sorted(captured)])[:length]
        torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
        v_ref = cache.values[0].transpose(0, 1)
        v = torch.cat([captured[p][1][layer] for p in sorted(captured)])[:length]
        torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)
