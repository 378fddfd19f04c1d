"""gpt-oss (sliding-window and full layers, sinks) and Gemma 3 (at TP 2) in the real daemon
with a native decode (the decode SDK, NIXL), full-pool mode: its published KV layout has
every layer, and a prompt longer than the window lands in the decode's pages with every full
layer's K/V at every position and every sliding layer's over the last ``window - 1``
positions (all a decode reads) equal to transformers', beside the first token transformers
picks. The pools are whole afterwards and the worker drains to exit 0. A windowed worker
(``cache.sliding_pool windowed``, TP 1) sends the same from its sliding layers' own pages,
whose pages are held by no request afterwards (the prefix cache keeps the prompt's last
window, which the metric does not count). At TP 2 the same (each rank computes and writes its
KV head, with its 3 query heads (gpt-oss: their sinks, half of every expert), into one decode
of TP 1). The KV events, windowed or not, name only the model's full-attention KV-cache group,
as vLLM 0.34 numbers the groups (gpt-oss [L0] [L2] [L1]: group 2; Gemma 3 [L0] [L2] [L3]
[L1]: group 3): a sliding page is no reusable prefix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import RoomState
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import Decode, start_worker, wait_until
from tests.integration.daemon.test_hybrid_daemon import published_events

TOL = 1e-4


IDS = prompt(70, seed=11)
LAYERS = {"gpt_oss": 3, "gemma3": 4}  # layer 1 of each is full, the others slide (window 24)
FULL_GROUP = {"gpt_oss": 2, "gemma3": 3}  # vLLM 0.34's group of layer 1
KV_EVENTS = (
    "kv_events.enabled=true",
    "kv_events.publish_bind=tcp://127.0.0.1:0",
    "kv_events.replay_bind=tcp://127.0.0.1:0",
)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``reference(family)``: the checkpoint, and transformers' output (with its cache)
    for ``IDS``, made once per family."""
    made: dict[str, tuple] = {}

    def reference(family: str) -> tuple:
        if family not in made:
            checkpoint = make_checkpoint(family, tmp_path_factory.mktemp(family) / "ckpt")
            with torch.no_grad():
                made[family] = checkpoint, hf_model(checkpoint)(torch.tensor([IDS]), use_cache=True)
        return made[family]

    return reference


@pytest.mark.parametrize(
    ("family", "tp_size", "sliding_pool"),
    [
        ("gpt_oss", 1, "full"),
        ("gpt_oss", 1, "windowed"),
        ("gpt_oss", 2, "full"),
        ("gemma3", 2, "full"),
    ],
)
def test_a_sliding_prompt_lands_whole_at_a_native_decode(
    tmp_path: Path, references, family: str, tp_size: int, sliding_pool: str
) -> None:  # type: ignore[no-untyped-def]
    (checkpoint, out), ids = references(family), IDS
    windowed = sliding_pool == "windowed"
    overrides = ("cache.num_pages=32", f"parallel.tp_size={tp_size}", *KV_EVENTS)
    overrides += ("cache.sliding_pool=windowed",) if windowed else ()
    worker = start_worker(tmp_path, checkpoint, *overrides)
    try:
        worker.child.wait_ready(120)
        decode, router = Decode(worker.bootstrap), BlockingRouterClient(worker.ingress)
        assert len(decode.k) == LAYERS[family]  # every layer, sliding or full
        decode.want(4301, len(ids))
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(router.prefill, ids, 4301, timeout_s=60)
            status = decode.wait([4301])[4301]
            result = sent.result(60)
        assert result.status is OutcomeStatus.OK, result
        assert status.state is RoomState.DONE, status
        assert result.first_token_id == int(out.logits[0, -1].argmax())
        for layer, cached in enumerate(out.cache.layers):
            k_ref, v_ref = cached.keys[0].transpose(0, 1), cached.values[0].transpose(0, 1)
            kept = k_ref.shape[0]
            assert kept == (len(ids) if layer == 1 else 23)
            k, v = decode.kv(4301, len(ids), layer)
            torch.testing.assert_close(k[-kept:], k_ref, atol=TOL, rtol=1e-5)
            torch.testing.assert_close(v[-kept:], v_ref, atol=TOL, rtol=1e-5)
        router.close()
        decode.close()

        def pools_whole() -> bool:
            metrics = worker.http("/metrics")[1]
            used = ("prefill_worker_aux_rows_used 0.0", "prefill_worker_kv_pages_used 0.0")
            if windowed:  # the sliding layers' own pages too
                used += ("prefill_worker_sliding_pages_used 0.0",)
            return all(line in metrics.splitlines() for line in used)

        wait_until(pools_whole, 30, "every aux row and page back")
        full_pages = len(ids) // 4

        def stored_events() -> list[dict[str, object]]:
            return [e for e in published_events(worker) if e["type"] == "BlockStored"]

        def stored_tokens() -> int:
            return sum(len(e["token_ids"]) for e in stored_events())  # type: ignore[arg-type]

        # the publisher thread sends a batch after the cache stored it: wait for the last one
        wait_until(lambda: stored_tokens() >= full_pages * 4, 30, "every full page's event")
        stored = stored_events()
        assert {(e["group_idx"], e["kv_cache_spec_kind"]) for e in stored} == {
            (FULL_GROUP[family], "full_attention")
        }
        assert not any("kv_cache_spec_sliding_window" in e for e in stored)
        tokens = [t for e in stored for t in e["token_ids"]]
        assert tokens == ids[: full_pages * 4]  # every full page of 4, once
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()
