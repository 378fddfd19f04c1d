"""SGLang's own decode code against an attention-DP worker (docs/sglang.md, "Attention-DP
workers"): a DP-2 worker and a DP-1 worker (SGLang's protocol, pages of 16, fp32), one
decode-side SGLang process.

- SGLang 0.5.23's decode finds the prefill rank by the room (its own
  ``_resolve_prefill_dp_rank`` over the worker's ``/route``: ``dp_size`` 2,
  ``follow_bootstrap_room``) and by query (its ``query_prefill_dp_ranks``, after the worker
  placed the room); a room of each parity, so both ranks serve. Each receiver ends Success,
  the first token the DP-1 worker's, the KV byte for byte the DP-1 worker's (each rank is a
  whole TP-1 worker); both ranks' pages free afterwards.
- A decode told another rank than the worker's (the router's ``disagg_prefill_dp_rank``
  off the room's rule) has its room fail at once with ``wrong_dp_rank``, naming the rank.

Newest pinned SGLang only (``PW_INTEROP_ALL=1``: every one)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from tests.checkpoints import prompt
from tests.interop.conftest import NUM_KV_HEADS, VERSIONS, Served, launch
from tests.interop.decodes import SglangDecode
from tests.patience import patient
from tests.polling import wait_until

pytestmark = pytest.mark.interop

PROMPT = prompt(37, seed=41)  # 3 pages of 16, the last partial
ALL_VERSIONS = os.environ.get("PW_INTEROP_ALL") == "1"
SETTINGS = ("scheduler.optimistic_prefill=false",)  # the same chunks whenever the want comes
PAGES = re.compile(r'^prefill_worker_dp_kv_pages\{dp_rank="(\d)",kind="(\w+)"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def workers(
    sglang_version: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Served]]:
    """The worker at DP 1 and at DP 2 (started together)."""
    if sglang_version != VERSIONS[-1] and not ALL_VERSIONS:
        pytest.skip("runs on the newest pinned version (PW_INTEROP_ALL=1: on every one)")
    started = []
    for dp in (1, 2):
        where = tmp_path_factory.mktemp(f"worker-dp{dp}")
        settings = (*SETTINGS, f"parallel.dp_size={dp}")
        started.append(launch(where, checkpoint, 16, "float32", "sglang", "layer_major", *settings))
    try:
        yield [one.ready() for one in started]
    finally:
        for one in started:
            one.worker.child.kill()


def _receive(
    served: Served, decode: SglangDecode, room: int, resolve: str, tmp_path: Path
) -> tuple[int, np.ndarray, int]:
    """One room: the first token, its K and V bytes of the prompt's tokens, the rank asked."""
    with BlockingRouterClient(served.worker.ingress) as router, ThreadPoolExecutor(1) as pool:
        if resolve == "query":  # SGLang's decode asks once the router sent the request
            result = pool.submit(router.prefill, PROMPT, room, return_logprob=True)
            decode.want(room, len(PROMPT), resolve=resolve)
        else:
            decode.want(room, len(PROMPT), resolve=resolve)
            result = pool.submit(router.prefill, PROMPT, room, return_logprob=True)
        reply = result.result(timeout=patient(60))
    assert reply.status is OutcomeStatus.OK, reply
    assert decode.wait(room) == ("Success", None)
    landed = decode.landed(room, tmp_path)
    assert int(landed.output_ids[0]) == reply.first_token_id
    planes = [
        getattr(landed, plane)[layer].reshape(-1, NUM_KV_HEADS * 16 * 4)[: len(PROMPT)]
        for layer in range(served.layout.num_layers)
        for plane in ("k", "v")
    ]
    decode.free(room)
    return reply.first_token_id, np.stack(planes), decode.dp_ranks[room]


def _pages(served: Served) -> dict[tuple[str, str], float]:
    _, text = served.worker.http("/metrics")
    return {(rank, kind): float(value) for rank, kind, value in PAGES.findall(text)}


def test_sglangs_decode_finds_each_rank_by_room_and_by_query_and_gets_the_dp1_kv(
    decode_process: SglangDecodeProcess, workers: list[Served], tmp_path: Path
) -> None:
    one, two = workers
    first_token, want = _receive(one, SglangDecode(decode_process, one.sglang, one.layout),
                                 1_000, "room", tmp_path)[:2]  # fmt: skip
    decode = SglangDecode(decode_process, two.sglang, two.layout)
    asked = []
    for room, resolve in ((2_000, "room"), (2_001, "room"), (2_002, "query"), (2_003, "query")):
        token, got, dp_rank = _receive(two, decode, room, resolve, tmp_path)
        assert token == first_token and np.array_equal(got, want), (room, resolve)
        asked.append(dp_rank)
    assert asked == [0, 1, 0, 1]

    def whole() -> bool:
        pages = _pages(two)
        return len(pages) == 4 and all(pages[(r, "free")] == pages[(r, "total")] for r in "01")

    wait_until(whole, patient(10), "both ranks' pages free")


def test_a_room_asked_of_the_wrong_rank_fails_naming_the_right_one(
    decode_process: SglangDecodeProcess, workers: list[Served]
) -> None:
    two = workers[1]
    decode = SglangDecode(decode_process, two.sglang, two.layout)
    decode.want(3_001, len(PROMPT), resolve="rank:0")  # the router told it rank 0; room: 1
    state, reason = decode.wait(3_001, timeout_s=patient(20))
    assert state == "Failed", (state, reason)
    assert reason is not None and "served by attention-DP rank 1 of 2, not rank 0" in reason
