"""A TP-2 / EP-2 worker (two rank processes, gloo on CPU, fp32) on a tiny DeepSeek-V3: each
rank holds 8 of the 16 routed experts whole, tokens reach them by all-to-all. Over the
native protocol a decode of TP 1 receives a chunked prompt's latent rows within 1e-4 of
transformers' cache (TP 1's reference), the first token transformers' greedy one, DONE; the
pools are whole afterwards; SIGTERM drains both ranks. A placement that cannot run is
refused at start (exit 78) with its reason, before any rank process starts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.service.checkmodel import ModelCheck, check_model
from prefill_worker.service.config import load_config
from prefill_worker.service.daemon import Daemon
from tests.checkpoints import hf_model, make_checkpoint
from tests.integration.daemon.conftest import ROOT, Worker, start_worker, wait_ready
from tests.integration.daemon.test_mla_tp import CHUNKED, LatentDecode, pool_usage
from tests.integration.model.conftest import hf_mla_forward
from tests.polling import wait_until
from tests.reliability.test_tensor_parallel import rank_pids

TOL = 1e-4
ROOM = 4701


@dataclass
class Served:
    checkpoint: Path
    rows: list[torch.Tensor]  # the TP-1 decode's, per layer
    first_token_id: int
    usage: dict[str, float]  # the pools once the room is done


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ep-daemon") / "dsv3")


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp_path = tmp_path_factory.mktemp("ep-worker")
    worker: Worker = start_worker(tmp_path, checkpoint, "parallel.tp_size=2", "parallel.ep_size=2")
    try:
        wait_ready(worker)
        assert "expert parallel 2: rank 0 holds experts [0, 1, 2, 3, 4, 5, 6, 7]" in worker.log()
        router = BlockingRouterClient(worker.ingress)
        decode = LatentDecode(worker.bootstrap, 1)
        try:
            (rows,) = decode.receive(router, ROOM)
        finally:
            decode.close()
            router.close()
        whole = {"kv_pages_used": 0.0, "aux_rows_used": 0.0, "live_requests": 0.0}
        wait_until(lambda: pool_usage(worker) == whole, 10.0, "the pools whole")
        yield Served(checkpoint, rows, decode.first_token_id, pool_usage(worker))
        assert worker.child.stop() == 0, worker.log()  # SIGTERM drains both ranks
    finally:
        worker.child.kill()


def test_a_native_decode_gets_transformers_latent_and_first_token(served: Served) -> None:
    logits, hf_rows = hf_mla_forward(hf_model(served.checkpoint), CHUNKED)
    assert served.first_token_id == int(logits[-1].argmax())
    for layer, (got, want) in enumerate(zip(served.rows, hf_rows, strict=True)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=f"layer {layer}")
    assert served.usage == {"kv_pages_used": 0.0, "aux_rows_used": 0.0, "live_requests": 0.0}


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (("parallel.expert_placement=[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]",), "gives rank 1 no"),
        (("parallel.expert_placement=[0,1,0,1]",), "names 4 experts; the model routes 16"),
    ],
)
def test_a_placement_that_cannot_run_is_refused_with_exit_78(
    checkpoint: Path, settings: tuple[str, ...], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before any rank starts: the daemon in this process, no rank process appears."""
    flags = [f"model.path={checkpoint}", "metrics.bind=127.0.0.1:0", "parallel.tp_size=2",
             "parallel.ep_size=2", *settings]  # fmt: skip
    config = load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags)
    assert Daemon(config, env={}).run() == 78
    assert says in caplog.text
    assert not rank_pids(os.getpid())


def test_check_config_prints_each_rank_s_experts_or_the_reason(checkpoint: Path) -> None:
    def check(*settings: str) -> ModelCheck:
        flags = [f"model.path={checkpoint}", "parallel.tp_size=2", *settings]
        return check_model(load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags))

    notes = check("parallel.ep_size=2").notes
    assert any("expert parallel 2: 8 of 16 routed experts per rank" in n for n in notes), notes
    lopsided = check("parallel.ep_size=2", f"parallel.expert_placement={[0] * 15 + [1]}")
    assert any("1 to 15 of 16 routed experts per rank" in n for n in lopsided.notes)
    bad = check("parallel.ep_size=2", "parallel.expert_placement=[0,1]")
    assert any("names 2 experts; the model routes 16" in p for p in bad.problems)
