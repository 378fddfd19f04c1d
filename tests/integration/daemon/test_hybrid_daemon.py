"""A hybrid checkpoint (Qwen3.5) in the real daemon with a native decode (the decode SDK,
NIXL): the worker starts and is ready, its published KV layout has the full-attention layers
only, and a request is refused when its decode claims it, with a typed reason on both sides
(``state_unsupported``: no protocol carries the linear layers' state yet), the decode's pages
untouched. The worker stays up, serves the next request the same way, has every aux row
(state slot) and page back, and drains to exit 0."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import FinishReason, OutcomeStatus
from prefill_worker.transfer import RoomState
from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import Decode, start_worker, wait_until


def test_a_hybrid_request_is_refused_with_a_typed_reason(tmp_path: Path) -> None:
    checkpoint = make_checkpoint("qwen3_5", tmp_path / "qwen3_5")
    worker = start_worker(tmp_path, checkpoint, "cache.num_pages=32", "cache.num_aux_rows=4")
    try:
        worker.child.wait_ready(120)
        assert worker.http("/readyz")[0] == 200
        decode, router = Decode(worker.bootstrap), BlockingRouterClient(worker.ingress)
        assert len(decode.k) == 2  # the KV list: the 2 full-attention layers of 5
        for room in (4201, 4202):
            ids = prompt(37, seed=room)
            decode.want(room, len(ids))
            with ThreadPoolExecutor(1) as pool:
                sent = pool.submit(router.prefill, ids, room, timeout_s=60)
                status = decode.wait([room])[room]
                result = sent.result(60)
            assert result.status is OutcomeStatus.FAILED, result
            assert result.reason is FinishReason.TRANSFER_FAILED
            assert str(result.error).startswith("state_unsupported: the native protocol")
            assert status.state is RoomState.FAILED and "state_unsupported" in str(status.reason)
            assert all(not torch.any(layer) for layer in decode.k)  # nothing was written
        router.close()
        decode.close()

        def pools_whole() -> bool:  # the aux rows are the state slots: all back
            metrics = worker.http("/metrics")[1]
            used = ("prefill_worker_aux_rows_used 0.0", "prefill_worker_kv_pages_used 0.0")
            return all(line in metrics.splitlines() for line in used)

        wait_until(pools_whole, 30, "every aux row (state slot) and page back")
        assert "state_unsupported" in worker.log()
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()
