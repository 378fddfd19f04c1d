"""A DP-2 / EP-2 worker: two attention-DP rank processes (one gloo world, fp32, the tiny
random Qwen3-MoE: 8 experts, top 2, three sparse layers) sharing the routed experts, 4 on
each rank; every forward on both ranks in lockstep (``dp.lockstep``), a rank with no batch
running an idle one (the exchanges alone) while the other works.

Requests one at a time on rank 0 (rank 1 idle), then on rank 1 (rank 0 idle, so rank 1's
plan reaches rank 0 by the bell), then six at once over both ranks: native decodes on each
rank's own bootstrap receive K and V within 1e-4 of the TP-1 runner's (the same checkpoint
built in this process, one chunk per prompt), with its greedy first token and logprob. Every
rank's KV pages are free afterwards; SIGTERM drains both ranks (exit 0). A placement that
cannot run exits 78 before any rank starts; an ``ep_size`` other than ``dp_size`` is refused
when the configuration loads."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.model import build
from prefill_worker.request import OutcomeStatus, SamplingParams
from prefill_worker.service.checkmodel import ModelCheck, check_model
from prefill_worker.service.config import ConfigError, load_config
from prefill_worker.service.dp_leader import DpLeader
from prefill_worker.transfer import RoomState
from prefill_worker.transfer.decode.ranks import rank_bootstrap
from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import ROOT, start_worker, wait_ready
from tests.patience import patient
from tests.polling import wait_until
from tests.reliability.harness import Ledger, LiveDecode, Router
from tests.reliability.test_data_parallel import all_free, dp_pages
from tests.reliability.test_tensor_parallel import rank_pids

TOL = 1e-4
NUM_LAYERS = 3
# (room, prompt): rank room % 2. One alone on each rank, then six at once over both.
ALONE = [(300, prompt(23, seed=50)), (301, prompt(17, seed=51))]
TOGETHER = [(302 + i, prompt(9 + 4 * i, seed=52 + i)) for i in range(6)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("dp-ep") / "qwen3_moe")


@functools.cache
def tp1_model(checkpoint: Path) -> tuple:
    return build(checkpoint, dtype="float32", page_size=4, num_pages=32)


def tp1(checkpoint: Path, tokens: list[int]) -> tuple[int, float, list[torch.Tensor]]:
    """The TP-1 runner's greedy first token, its logprob, and K and V per layer (read back
    before the next prompt overwrites its pages)."""
    runner, kv_cache, _ = tp1_model(checkpoint)
    pages = list(range(-(-len(tokens) // 4)))
    chunk = ChunkPlan("r", tokens, 0, len(tokens), pages, SamplingParams())
    logits = runner.compute_logits(BatchPlan(0, (chunk,)))[0]
    logprob = float(torch.log_softmax(logits.float(), -1).max())
    n = len(tokens)
    kv = [torch.cat([cache[layer][p] for p in pages])[:n]
          for layer in range(NUM_LAYERS) for cache in (kv_cache.k, kv_cache.v)]  # fmt: skip
    return int(logits.argmax()), logprob, kv


def landed(decode: LiveDecode, room: int, n: int) -> list[torch.Tensor]:
    """The room's K and V per layer as the decode holds them: ``[n, KV, D]`` each."""
    pages, _ = decode.rooms[room]
    return [torch.stack([cache[layer][p] for p in pages]).flatten(0, 1)[:n]
            for layer in range(NUM_LAYERS) for cache in (decode.k, decode.v)]  # fmt: skip


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    worker = start_worker(
        tmp_path_factory.mktemp("dp-ep-worker"), checkpoint, "parallel.dp_size=2",
        "parallel.ep_size=2",
    )  # fmt: skip
    try:
        wait_ready(worker)
        endpoints = json.loads(worker.http("/readyz")[1])
        decodes = {r: LiveDecode(rank_bootstrap(endpoints, r)) for r in (0, 1)}
        router = Router(worker.ingress, Ledger())
        out: dict = {}
        try:
            for batch in ([ALONE[0]], [ALONE[1]], TOGETHER):
                for room, tokens in batch:
                    decodes[room % 2].want(room, len(tokens))
                rids = {
                    room: router.send_prefill(tokens, room, return_logprob=True)
                    for room, tokens in batch
                }
                replies = router.wait(list(rids.values()), timeout_s=patient(60))
                for room, tokens in batch:
                    decode = decodes[room % 2]
                    assert decode.wait([room])[room].state is RoomState.DONE
                    out[room] = replies[rids[room]], landed(decode, room, len(tokens))
        finally:
            router.close()
            for decode in decodes.values():
                decode.close()
        wait_until(lambda: all_free(dp_pages(worker)), patient(10), "every rank's pages free")
        out["pages"] = dp_pages(worker)
        assert worker.child.stop() == 0, worker.log()  # SIGTERM drains both ranks
        out["log"] = worker.child.log_path.read_text(errors="replace")
        yield out
    finally:
        worker.child.kill()


def test_each_rank_holds_half_of_the_experts_and_ran_idle_steps(served: dict) -> None:
    """Each rank's experts; at the stop each rank's step thread ended, having run idle
    forwards (the other rank's requests alone, and the warm-up's own forwards)."""
    log = served["log"]
    for rank, experts in ((0, "[0, 1, 2, 3]"), (1, "[4, 5, 6, 7]")):
        assert f"expert parallel 2: rank {rank} holds experts {experts}" in log
        ended = re.search(rf"dp rank {rank} lockstep ended: (\d+) forwards, (\d+) idle", log)
        assert ended is not None, log
        assert int(ended[1]) >= 4 and int(ended[2]) >= 1, ended[0]


@pytest.mark.parametrize(("room", "tokens"), ALONE + TOGETHER)
def test_first_token_and_kv_equal_tp1s(served: dict, checkpoint: Path, room, tokens) -> None:
    reply, kv = served[room]
    assert reply.status is OutcomeStatus.OK, reply
    token, logprob, want = tp1(checkpoint, tokens)
    assert reply.first_token_id == token
    assert abs(reply.first_token_logprob - logprob) <= TOL
    for index, (got, expected) in enumerate(zip(kv, want, strict=True)):
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0, msg=f"room {room} {index}")


def test_every_rank_s_pool_is_whole_afterwards(served: dict) -> None:
    pages = served["pages"]
    assert {rank for rank, _ in pages} == {"0", "1"}
    assert all_free(pages), pages


def test_a_placement_that_cannot_run_exits_78_before_any_rank_starts(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flags = [f"model.path={checkpoint}", "metrics.bind=127.0.0.1:0", "parallel.dp_size=2",
             "parallel.ep_size=2", f"parallel.expert_placement={[0] * 8}"]  # fmt: skip
    config = load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags)
    assert DpLeader(config, env={}).run() == 78
    assert "expert placement gives rank 1 no expert" in caplog.text
    assert not rank_pids(os.getpid())


def test_check_config_prints_each_dp_rank_s_experts_or_the_reason(checkpoint: Path) -> None:
    def check(*settings: str) -> ModelCheck:
        flags = [f"model.path={checkpoint}", "parallel.dp_size=2", *settings]
        return check_model(load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags))

    notes = check("parallel.ep_size=2").notes
    assert any("expert parallel 2: 4 of 8 routed experts per rank" in n for n in notes), notes
    bad = check("parallel.ep_size=2", f"parallel.expert_placement={[1] * 8}")
    assert any("gives rank 0 no expert" in p for p in bad.problems), bad.problems


def test_an_ep_size_that_is_not_the_dp_ranks_is_refused(checkpoint: Path) -> None:
    flags = [f"model.path={checkpoint}", "parallel.dp_size=2", "parallel.ep_size=4"]
    with pytest.raises(ConfigError, match=r"ep_size 4 must be 1 or dp_size \(2\) x tp_size"):
        load_config(ROOT / "configs/tiny-test.yaml", env={}, overrides=flags)


@pytest.mark.slow
def test_a_stopped_rank_fails_the_worker_as_one_answering_all(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Rank 1 stopped (SIGSTOP) with requests in flight on both ranks: rank 0's next vote
    waits out ``parallel.step_timeout_s`` (2 s here), the lockstep fails, every request is
    answered (failed) and the worker exits 70."""
    worker = start_worker(
        tmp_path, checkpoint, "parallel.dp_size=2", "parallel.ep_size=2",
        "parallel.step_timeout_s=2", "parallel.heartbeat_interval_s=0.5",
    )  # fmt: skip
    rank_pid = 0
    try:
        wait_ready(worker)
        rank_pid = json.loads(worker.http("/readyz")[1])["dp_ranks"][0]["pid"]
        router = Router(worker.ingress, Ledger())
        try:
            rids = [router.send_prefill(prompt(40, seed=i), 600 + i) for i in range(6)]
            os.kill(rank_pid, signal.SIGSTOP)  # no decode claims them: all still in flight
            replies = router.wait(rids, timeout_s=patient(30))
        finally:
            router.close()
        assert worker.wait_exit(30) == 70, worker.log()
        assert all(r.status is not OutcomeStatus.OK for r in replies.values()), replies
        assert "attention-DP lockstep failed on rank 0" in worker.child.log_path.read_text()
    finally:
        if rank_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank_pid, signal.SIGKILL)
        worker.child.kill()
