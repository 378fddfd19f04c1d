"""SGLang's own decode-side code with attention TP 2 (two decode-side rank processes, each
registering as its rank with a pool of its one KV head) receiving from the worker (TP 1):
each rank's receiver ends Success with the first token in its metadata row, and the two
ranks' pages, head by head, are byte for byte what SGLang's TP-1 decode (the version's own
decode process) received for the same prompt. On the newest pinned version (two extra SGLang
processes cost about 1.5 min per version on CI's 2 cores); ``PW_INTEROP_ALL=1`` runs it on
every one. One worker for all."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from tests.checkpoints import prompt
from tests.interop.conftest import HEAD_DIM, NUM_KV_HEADS, VERSIONS, Served, launch, sglang_path
from tests.interop.decodes import SglangDecode, new_room

pytestmark = pytest.mark.interop

PROMPT = prompt(37, seed=27)  # 3 pages of 16, several chunks, the last page partial
TP_SIZE = 2
ALL_VERSIONS = os.environ.get("PW_INTEROP_ALL") == "1"


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp_path = tmp_path_factory.mktemp("decode-tp")
    one = launch(tmp_path, checkpoint, 16, "float32", "sglang")
    try:
        yield one.ready()
    finally:
        one.worker.child.kill()


@pytest.fixture(scope="module")
def router(served: Served) -> Iterator[BlockingRouterClient]:
    client = BlockingRouterClient(served.worker.ingress)
    yield client
    client.close()


@pytest.fixture
def rank_processes(
    sglang_version: str, checkpoint: Path, tmp_path: Path
) -> Iterator[list[SglangDecodeProcess]]:
    """The decode's two attention-TP ranks, one process each (started together)."""
    if sglang_version != VERSIONS[-1] and not ALL_VERSIONS:
        pytest.skip("runs on the newest pinned version (PW_INTEROP_ALL=1: on every one)")
    path = sglang_path(sglang_version)
    processes = [
        SglangDecodeProcess(
            sys.executable, path, checkpoint, tmp_path / f"rank{r}.log", attn_tp=(r, TP_SIZE)
        )
        for r in range(TP_SIZE)
    ]
    yield processes
    for process in processes:
        process.close()


def _prefill(router: BlockingRouterClient, room: int) -> int:
    # Prompt logprobs from 0: no prefix-cache hit, every request computes every token alike.
    result = router.prefill(PROMPT, room, return_logprob=True, logprob_start_len=0)
    assert result.status is OutcomeStatus.OK, result
    return result.first_token_id


def test_an_attention_tp_2_decode_gets_the_tp1_kv_head_by_head(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    served: Served,
    router: BlockingRouterClient,
    tmp_path: Path,
) -> None:
    reference = SglangDecode(decode_process, served.sglang, served.layout)
    ref_room = new_room()
    reference.want(ref_room, len(PROMPT))
    first_token = _prefill(router, ref_room)
    assert reference.wait(ref_room) == ("Success", None)
    ref = reference.landed(ref_room, tmp_path)

    rank_layout = dataclasses.replace(served.layout, num_kv_heads=NUM_KV_HEADS // TP_SIZE)
    ranks = [SglangDecode(p, served.sglang, rank_layout) for p in rank_processes]
    room = new_room()
    for rank in ranks:
        rank.want(room, len(PROMPT))
    assert _prefill(router, room) == first_token
    with ThreadPoolExecutor(TP_SIZE) as pool:
        states = list(pool.map(lambda rank: rank.wait(room), ranks))
    assert states == [("Success", None)] * TP_SIZE
    landed = [rank.landed(room, tmp_path) for rank in ranks]
    for got in landed:
        assert int(got.output_ids[0]) == first_token
    for layer in range(served.layout.num_layers):
        for ref_pages, rank_pages in (
            (ref.k[layer], [g.k[layer] for g in landed]),
            (ref.v[layer], [g.v[layer] for g in landed]),
        ):
            # [tokens, heads, bytes of a head]; past the prompt a page holds whatever the
            # worker's page held there (its pages differ per request): not compared.
            want = ref_pages.reshape(-1, NUM_KV_HEADS, HEAD_DIM * 4)[: len(PROMPT)]
            got = np.concatenate([p.reshape(-1, 1, HEAD_DIM * 4) for p in rank_pages], axis=1)
            assert np.array_equal(got[: len(PROMPT)], want), layer
