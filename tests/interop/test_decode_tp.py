"""SGLang's own decode-side code at attention TP 1 and 2 (two decode-side rank processes, each
registering as its rank with a pool of its one KV head) receiving from the worker at TP 1
and TP 2 (two rank processes, one KV head each: docs/sglang.md, "Workers with TP > 1"):

- worker TP 1 → decode TP 2: each rank's pages, head by head, are byte for byte what SGLang's
  TP-1 decode received from the same worker;
- worker TP 2 → decode TP 1 (the decode asks both worker ranks, the leader answering for
  each; two `KV_STATUS`) and → decode TP 2 (each decode rank asks its worker rank): every
  head arrives, byte for byte the same over both decode shapes, within 1e-4 of the TP-1
  worker's KV (the TP-2 forward sums in another order), the first token the TP-1 worker's.

Each receiver ends Success with the first token in its metadata row. On the newest pinned
version (two extra SGLang processes cost about 1.5 min per version on CI's 2 cores);
``PW_INTEROP_ALL=1`` runs it on every one. One worker of each TP size, and one pair of rank
processes, for all cases."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from tests.checkpoints import prompt
from tests.interop.conftest import HEAD_DIM, NUM_KV_HEADS, TP_SIZE, Served, launch_tp
from tests.interop.decodes import Landed, SglangDecode, new_room

pytestmark = [pytest.mark.interop, pytest.mark.newest_sglang]

PROMPT = prompt(37, seed=27)  # 3 pages of 16, several chunks, the last page partial
TOL = 1e-4


@pytest.fixture(scope="module")
def workers(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Served]]:
    """The worker at TP 1 and at TP 2 (started together)."""
    started = [
        launch_tp(tmp_path_factory.mktemp(f"worker-tp{tp}"), checkpoint, tp) for tp in (1, TP_SIZE)
    ]
    try:
        yield [one.ready() for one in started]
    finally:
        for one in started:
            one.worker.child.kill()


@pytest.fixture(scope="module")
def routers(workers: list[Served]) -> Iterator[list[BlockingRouterClient]]:
    clients = [BlockingRouterClient(one.worker.ingress) for one in workers]
    yield clients
    for client in clients:
        client.close()


def _prefill(router: BlockingRouterClient, room: int) -> int:
    # Prompt logprobs from 0: no prefix-cache hit, every request computes every token alike.
    result = router.prefill(PROMPT, room, return_logprob=True, logprob_start_len=0)
    assert result.status is OutcomeStatus.OK, result
    return result.first_token_id


def _receive(
    router: BlockingRouterClient, ranks: Sequence[SglangDecode], tmp_path: Path
) -> tuple[int, list[Landed]]:
    """One room into a decode of ``len(ranks)`` ranks: its first token and each rank's pages,
    once every rank's receiver said Success."""
    room = new_room()
    for rank in ranks:
        rank.want(room, len(PROMPT))
    first_token = _prefill(router, room)
    with ThreadPoolExecutor(len(ranks)) as pool:
        states = list(pool.map(lambda rank: rank.wait(room), ranks))
    assert states == [("Success", None)] * len(ranks)
    landed = [rank.landed(room, tmp_path) for rank in ranks]
    for got in landed:
        assert int(got.output_ids[0]) == first_token
    return first_token, landed


def _heads(landed: Sequence[Landed], plane: str, layer: int) -> np.ndarray:
    """The prompt's tokens of one layer's K or V over the decode's ranks, reassembled:
    ``[tokens, heads, bytes of a head]`` (past the prompt a page holds whatever the worker's
    page held there, which differs per request: not compared)."""
    per_rank = [getattr(got, plane)[layer] for got in landed]
    heads = NUM_KV_HEADS // len(landed)
    parts = [p.reshape(-1, heads, HEAD_DIM * 4)[: len(PROMPT)] for p in per_rank]
    return np.concatenate(parts, axis=1)


def _decode(process: SglangDecodeProcess, served: Served, ranks: int) -> SglangDecode:
    layout = dataclasses.replace(served.layout, num_kv_heads=NUM_KV_HEADS // ranks)
    return SglangDecode(process, served.sglang, layout)


def test_an_attention_tp_2_decode_gets_the_tp1_kv_head_by_head(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    workers: list[Served],
    routers: list[BlockingRouterClient],
    tmp_path: Path,
) -> None:
    tp1, router = workers[0], routers[0]
    first_token, ref = _receive(router, [_decode(decode_process, tp1, 1)], tmp_path)
    ranks = [_decode(p, tp1, TP_SIZE) for p in rank_processes]
    token, got = _receive(router, ranks, tmp_path)
    assert token == first_token
    for layer in range(tp1.layout.num_layers):
        for plane in ("k", "v"):
            assert np.array_equal(_heads(got, plane, layer), _heads(ref, plane, layer)), layer


def test_a_tp_2_worker_feeds_attention_tp_1_and_2_decodes_every_head(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    workers: list[Served],
    routers: list[BlockingRouterClient],
    tmp_path: Path,
) -> None:
    tp1, tp2 = workers
    first_token, ref = _receive(routers[0], [_decode(decode_process, tp1, 1)], tmp_path)
    whole_token, whole = _receive(routers[1], [_decode(decode_process, tp2, 1)], tmp_path)
    ranks = [_decode(p, tp2, TP_SIZE) for p in rank_processes]
    split_token, split = _receive(routers[1], ranks, tmp_path)
    assert whole_token == split_token == first_token
    for layer in range(tp1.layout.num_layers):
        for plane in ("k", "v"):
            got = _heads(whole, plane, layer)
            assert np.array_equal(_heads(split, plane, layer), got), (plane, layer)
            want = _heads(ref, plane, layer).view(np.float32)
            np.testing.assert_allclose(got.view(np.float32), want, atol=TOL, rtol=0)
