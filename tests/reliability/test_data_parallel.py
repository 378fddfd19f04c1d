"""An attention-DP worker: real rank processes (one gloo world) behind one ingress.

The same requests, one at a time, to a DP-1 and a DP-2 worker (the tiny llama, fp32): the
DP-2 worker places each on rank ``bootstrap_room % 2`` (both ranks serve), and native decodes,
one on each rank's own bootstrap socket (``/readyz``'s ``dp_ranks``), receive KV byte for byte
what the DP-1 worker's decode received, with the same first tokens and logprobs (within 1e-4;
each rank is a whole TP-1 worker running the same one-prompt forwards). Afterwards every
rank's KV pages are free again (``prefill_worker_dp_kv_pages``). SIGTERM drains every rank:
exit 0. A rank stopped (SIGSTOP) is named by ``/livez`` (503) at once; killed with requests in
flight, it fails the worker as a TP group does: exit 70, every request answered.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import RoomState
from prefill_worker.transfer.decode.ranks import rank_bootstrap
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Worker, start_worker, wait_ready
from tests.patience import patient
from tests.polling import wait_until
from tests.reliability.harness import Ledger, LiveDecode, Router, scrape

TOL = 1e-4
PROMPTS = [prompt(9 + 5 * i, seed=30 + i) for i in range(4)]
ROOMS = [101, 102, 103, 104]  # two on each rank of two


def serve(worker: Worker) -> dict[int, tuple[object, list[torch.Tensor]]]:
    """Each prompt to its room, a native decode on the rank serving it (the SDK's
    ``rank_bootstrap``); the reply and the room's K and V (two layers)."""
    endpoints = json.loads(worker.http("/readyz")[1])
    decodes: dict[str, LiveDecode] = {}
    router = Router(worker.ingress, Ledger())
    out = {}
    try:
        for room, tokens in zip(ROOMS, PROMPTS, strict=True):  # one at a time: each forward
            where = rank_bootstrap(endpoints, room)  # is one prompt alone at any DP size
            decode = decodes.get(where) or decodes.setdefault(where, LiveDecode(where))
            decode.want(room, len(tokens))
            rid = router.send_prefill(tokens, room, return_logprob=True)
            reply = router.wait([rid])[rid]
            assert decode.wait([room])[room].state is RoomState.DONE
            pages, _ = decode.rooms[room]
            n = len(tokens)  # the last page's rest is the decode's own
            kv = [torch.stack([cache[layer][p] for p in pages]).flatten(0, 1)[:n]
                  for layer in range(2) for cache in (decode.k, decode.v)]  # fmt: skip
            out[room] = reply, kv
        assert len(decodes) == endpoints.get("dp_size", 1)  # every rank served
        if len(decodes) > 1:
            out[0] = wrong_rank(decodes[endpoints["bootstrap"]]), []
    finally:
        router.close()
        for decode in decodes.values():
            decode.close()
    return out


def wrong_rank(decode: LiveDecode) -> str | None:
    """A want for rank 1's room sent to rank 0: its status, at once (no request sent)."""
    decode.want(105, 8)
    status = decode.wait([105], timeout_s=10)[105]
    assert status.state is RoomState.FAILED, status
    return status.reason


def dp_pages(worker: Worker) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["dp_rank"], dict(labels)["kind"]): value
        for (name, labels), value in scrape(worker).items()
        if name == "prefill_worker_dp_kv_pages"
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[dict]:
    """The DP-1 and DP-2 workers (started together), served in turn, then drained."""
    workers = {
        dp: start_worker(tmp_path_factory.mktemp(f"dp{dp}"), checkpoint, f"parallel.dp_size={dp}")
        for dp in (1, 2)
    }
    results = {}
    try:
        for dp, worker in workers.items():
            wait_ready(worker)
            answers = serve(worker)
            pages: dict[tuple[str, str], float] = {}
            if dp > 1:
                wait_until(lambda w=worker: all_free(dp_pages(w)), patient(10), "free pages")
                pages = dp_pages(worker)
            assert worker.child.stop() == 0, worker.log()  # SIGTERM drains every rank
            results[dp] = answers, pages
    finally:
        for worker in workers.values():
            worker.child.kill()  # no worker outlives a failed script
    yield results


def all_free(pages: dict[tuple[str, str], float]) -> bool:
    ranks = {rank for rank, _ in pages}
    return bool(ranks) and all(pages[(r, "free")] == pages[(r, "total")] for r in ranks)


def test_both_ranks_serve_the_dp1_first_tokens_and_kv(served: dict) -> None:
    one, two = served[1][0], served[2][0]
    for room in ROOMS:
        (a, kv_a), (b, kv_b) = one[room], two[room]  # rank room % 2 of the DP-2 worker
        assert a.status is OutcomeStatus.OK and b.status is OutcomeStatus.OK, (a, b)
        assert a.first_token_id == b.first_token_id
        assert abs(a.first_token_logprob - b.first_token_logprob) <= TOL
        for x, y in zip(kv_a, kv_b, strict=True):
            assert torch.equal(x, y), f"room {room}: KV differs by {(x - y).abs().max()}"


def test_a_want_on_the_wrong_rank_fails_at_once_naming_the_right_one(served: dict) -> None:
    reason = served[2][0][0][0]
    assert reason is not None and "served by attention-DP rank 1 of 2, not rank 0" in reason


def test_every_ranks_pool_is_whole_afterwards(served: dict) -> None:
    pages = served[2][1]
    assert {rank for rank, _ in pages} == {"0", "1"}
    assert all_free(pages), pages


def test_a_stopped_rank_is_named_and_a_killed_one_fails_the_worker_answering_all(
    tmp_path: Path, checkpoint: Path
) -> None:
    worker = start_worker(tmp_path, checkpoint, "parallel.dp_size=2")
    try:
        wait_ready(worker)
        rank_pid = json.loads(worker.http("/readyz")[1])["dp_ranks"][0]["pid"]
        os.kill(rank_pid, signal.SIGSTOP)  # /livez names a stopped rank at once
        stuck = f"an attention-DP rank 1 (pid {rank_pid}) is stopped"
        wait_until(lambda: stuck in worker.http("/livez")[1], patient(10), "/livez")
        assert worker.http("/livez")[0] == 503
        router = Router(worker.ingress, Ledger())
        try:
            rids = [router.send_prefill(prompt(12, seed=i), 500 + i) for i in range(4)]
            os.kill(rank_pid, signal.SIGKILL)  # no decode claims them: all still in flight
            started = time.monotonic()
            replies = router.wait(rids, timeout_s=patient(30))
        finally:
            router.close()
        assert worker.wait_exit(30) == 70, worker.log()
        assert time.monotonic() - started < patient(15)
        assert all(r.status is not OutcomeStatus.OK for r in replies.values()), replies
    finally:
        worker.child.kill()
