"""gpt-oss from a worker of tensor parallel 2 (``prefill-worker serve``, SGLang's protocol;
each rank one of its 2 KV heads, ``cache.sliding_pool: full``) to SGLang 0.5.23's own decode
code, a prompt past the window (70 tokens, window 24, pages of 16, three chunks), as
``test_swa_worker.py`` sends it from one rank:

- decodes of attention TP 1 with hybrid SWA memory (its ``SWAKVPool``: the full layer in its
  KV pool, the sliding layers' window pages in its SWA pool; each worker rank writes its head
  of every token into both) and without (``--disable-hybrid-swa-memory``: every layer in its
  KV pool): both say Success, the K/V that landed equal transformers' where a decode reads
  them, and the window pages are byte for byte the full-pool decode's;
- the ranks of decodes of attention TP 2, with hybrid SWA memory and without (each worker
  rank writes its decode rank's head whole, pages and window pages): each rank holds, byte
  for byte, its head of what the decode of attention TP 1 holds;
- and from a worker of TP 1 (both heads; started beside the group) to the ranks of a decode
  of attention TP 2 with hybrid SWA memory: token runs of each rank's head into its pages
  and window pages, byte for byte that worker's decode of attention TP 1.

The worker's pages and aux rows are all back afterwards."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.layout import KVLayout
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from prefill_worker.transfer.swa_window import WINDOW, layer_pages
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.interop.conftest import TP_SIZE, assert_pools_whole, launch
from tests.interop.decodes import SglangDecode, dump, new_room
from tests.interop.test_swa_worker import KEPT, PAGE, SHAPES, check, check_swa

pytestmark = [pytest.mark.interop, pytest.mark.newest_sglang]

NUM_LAYERS, HEADS, DIM, SLIDING = SHAPES["gpt_oss"]
FULL = tuple(i for i in range(NUM_LAYERS) if i not in SLIDING)
LAYOUT = KVLayout(NUM_LAYERS, HEADS, DIM, "float32", PAGE, 64)
SWA = (SLIDING, KEPT, 32)  # a decode's hybrid SWA pool: sliding layers, window, its pages
LENGTH = 70


@pytest.fixture(scope="module")
def workers(sglang_version: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The worker at TP 2 and at TP 1, started together; each waited for by its fixture."""
    if sglang_version != "0.5.23":
        pytest.skip("sliding-window models are proven against SGLang 0.5.23")
    tmp_path = tmp_path_factory.mktemp("swa-tp2")
    checkpoint = make_checkpoint("gpt_oss", tmp_path / "gpt_oss")
    settings = ("scheduler.optimistic_prefill=false",)  # the same chunks for every decode
    group = launch(tmp_path, checkpoint, PAGE, "float32", "sglang", "layer_major", *settings,
                   f"parallel.tp_size={TP_SIZE}")  # fmt: skip
    (tmp_path / "tp1").mkdir()
    one = launch(tmp_path / "tp1", checkpoint, PAGE, "float32", "sglang", "layer_major", *settings)
    try:
        yield checkpoint, group, one
        for started in (group, one):
            assert started.worker.child.stop() == 0, started.worker.log()
    finally:
        group.worker.child.kill()
        one.worker.child.kill()


@pytest.fixture(scope="module")
def group(workers):  # type: ignore[no-untyped-def]
    checkpoint, group, _ = workers
    return checkpoint, group.ready()


def test_decodes_of_attention_tp_1_get_every_ranks_head(
    decode_process: SglangDecodeProcess, group, tmp_path: Path
) -> None:
    checkpoint, served = group
    ids = prompt(LENGTH, seed=5)
    with torch.no_grad():
        cache = hf_model(checkpoint)(torch.tensor([ids]), use_cache=True).past_key_values
    reference = [(c.keys[0].transpose(0, 1), c.values[0].transpose(0, 1)) for c in cache.layers]
    full_pool = SglangDecode(decode_process, served.sglang, LAYOUT)
    swa_pool = SglangDecode(decode_process, served.sglang, LAYOUT, swa=SWA)
    client = BlockingRouterClient(served.worker.ingress)
    try:
        [full] = receive(client, [full_pool], ids, tmp_path)
        [swa] = receive(client, [swa_pool], ids, tmp_path)
    finally:
        client.close()
    for layer in range(NUM_LAYERS):  # every layer, every page: both heads, transformers'
        check(full[0][f"k{layer}"], full[0][f"v{layer}"], reference[layer], layer in SLIDING,
              HEADS, DIM)  # fmt: skip
    check_swa(swa, full[0], reference, SLIDING, NUM_LAYERS, (HEADS, DIM))
    assert_pools_whole(served.worker)


def test_decodes_of_attention_tp_2_get_their_head_whole(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    group,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    _, served = group
    ids = prompt(LENGTH, seed=6)
    half = dataclasses.replace(LAYOUT, num_kv_heads=HEADS // TP_SIZE)
    client = BlockingRouterClient(served.worker.ingress)
    try:
        [whole] = receive(client, [SglangDecode(decode_process, served.sglang, LAYOUT)], ids,
                          tmp_path)  # fmt: skip
        swa_ranks = [SglangDecode(p, served.sglang, half, swa=SWA) for p in rank_processes]
        full_ranks = [SglangDecode(p, served.sglang, half) for p in rank_processes]
        landed_swa = receive(client, swa_ranks, ids, tmp_path)
        landed_full = receive(client, full_ranks, ids, tmp_path)
    finally:
        client.close()
    window = layer_pages(LENGTH, PAGE, 0, KEPT, WINDOW)
    for rank in range(TP_SIZE):
        (full, _), (swa, swa_pages) = landed_full[rank], landed_swa[rank]
        assert len(swa_pages) == len(window)
        for layer in range(NUM_LAYERS):
            for plane in "kv":
                mine = head_of(whole[0][f"{plane}{layer}"], rank)
                assert np.array_equal(as_head(full[f"{plane}{layer}"]), mine), (rank, layer)
                if layer in SLIDING:  # its window pages, in its SWA pool
                    got = swa[f"swa_{plane}{SLIDING.index(layer)}"]
                    expected = mine[window.start : window.stop]
                else:
                    got, expected = swa[f"{plane}{FULL.index(layer)}"], mine
                assert np.array_equal(as_head(got), expected), (rank, layer, plane)
    assert_pools_whole(served.worker)


def test_a_tp_1_worker_writes_each_decode_rank_its_head_of_the_window(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    workers,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    _, _, one = workers
    served = one.ready()
    ids = prompt(LENGTH, seed=7)
    half = dataclasses.replace(LAYOUT, num_kv_heads=HEADS // TP_SIZE)
    client = BlockingRouterClient(served.worker.ingress)
    try:
        [whole] = receive(client, [SglangDecode(decode_process, served.sglang, LAYOUT, swa=SWA)],
                          ids, tmp_path)  # fmt: skip
        ranks = [SglangDecode(p, served.sglang, half, swa=SWA) for p in rank_processes]
        landed = receive(client, ranks, ids, tmp_path)
    finally:
        client.close()
    for rank, (pages, swa_pages) in enumerate(landed):
        assert len(swa_pages) == len(whole[1])
        for name, got in pages.items():  # k0, v0 (the full layer); swa_k0.. (the window)
            assert np.array_equal(as_head(got), head_of(whole[0][name], rank)), (rank, name)
    assert_pools_whole(served.worker)


def receive(
    client: BlockingRouterClient, ranks: list[SglangDecode], ids: list[int], tmp_path: Path
) -> list[tuple[dict[str, np.ndarray], list[int]]]:
    """One room into a decode of ``len(ranks)`` ranks: each rank's (pages, SWA window
    pages), once every rank's receiver said Success."""
    room = new_room()
    for rank in ranks:
        rank.want(room, len(ids))
    result = client.prefill(ids, room, timeout_s=60)
    assert result.status is OutcomeStatus.OK, result
    with ThreadPoolExecutor(len(ranks)) as pool:
        states = list(pool.map(lambda rank: rank.wait(room), ranks))
    assert states == [("Success", None)] * len(ranks)
    return [(dump(rank, room, tmp_path), rank.swa_pages[room]) for rank in ranks]


def head_of(pages: np.ndarray, rank: int) -> np.ndarray:
    """Head ``rank`` of every token of pages of every head, ``[pages, PAGE, head bytes]``."""
    return pages.reshape(len(pages), PAGE, HEADS, DIM * 4)[:, :, rank]


def as_head(pages: np.ndarray) -> np.ndarray:
    """A decode rank's pages of one head, ``[pages, PAGE, head bytes]``."""
    return pages.reshape(len(pages), PAGE, DIM * 4)
