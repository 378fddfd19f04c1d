"""Proof of the whole path: router → worker (prefill, KV pushed over NIXL) → reference decode
peer (greedy continuation over the received pages) equals ``transformers`` ``generate``."""

from __future__ import annotations

import asyncio
import functools
import signal
from concurrent.futures import ThreadPoolExecutor

import torch

from prefill_worker.ingress.client import BlockingRouterClient, RouterClient
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.peer_control import DecodePeerClient
from tests.checkpoints import hf_model, prompt
from tests.integration.e2e.conftest import start_peer_process
from tests.patience import patient

LENGTHS = (3, 16, 29, 47, 70)  # chunk_size 16, page_size 4: one chunk, several, ragged ends
NUM_NEW_TOKENS = 20


@functools.cache
def greedy_model(checkpoint):  # type: ignore[no-untyped-def]
    model = hf_model(checkpoint)
    model.generation_config.eos_token_id = None  # the decode peer has no stop tokens either
    return model


def hf_generate(checkpoint, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    model = greedy_model(checkpoint)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),  # ids may hold pad/eos ids
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


def test_decode_continuation_equals_transformers_generate(worker, decode_peer, checkpoint) -> None:
    prompts = {room: prompt(n, seed=room) for room, n in enumerate(LENGTHS, start=1001)}
    with BlockingRouterClient(worker.ingress) as router, ThreadPoolExecutor(len(prompts)) as pool:
        futures = {room: pool.submit(router.prefill, ids, room) for room, ids in prompts.items()}
        generations = decode_peer.generate(prompts, NUM_NEW_TOKENS, timeout_s=60)
        results = {room: future.result(timeout=patient(60)) for room, future in futures.items()}
    assert decode_peer.is_idle
    decode_peer.pages.check_integrity()
    assert decode_peer.pages.num_free == decode_peer.pages.num_pages  # every page came back
    for room, ids in prompts.items():
        result, generation = results[room], generations[room]
        assert result.status is OutcomeStatus.OK, result
        assert generation.is_ok, generation
        assert len(generation.token_ids) == NUM_NEW_TOKENS
        assert generation.token_ids[0] == result.first_token_id  # the aux row matches the reply
        assert list(generation.token_ids) == hf_generate(checkpoint, ids), f"prompt {len(ids)}"


def test_failed_transfer_is_reported_not_decoded(worker, decode_peer) -> None:
    """No prefill for this room ever reaches the worker: the want times out on its side and
    the decode peer reports the failure with its pages freed."""
    generations = decode_peer.generate({77: prompt(9, seed=77)}, 4, timeout_s=30)
    assert not generations[77].is_ok
    assert generations[77].token_ids == ()
    assert "failed" in (generations[77].error or "")
    assert decode_peer.pages.num_free == decode_peer.pages.num_pages


def test_decode_peer_process_serves_and_stops_cleanly(worker, checkpoint, tmp_path) -> None:
    """`prefill-worker decode-peer` as a process: READY=1, the same tokens as in process over
    its control socket, exit 0 on SIGTERM."""
    ids = prompt(21, seed=5)
    peer, control = start_peer_process(worker.bootstrap, checkpoint, tmp_path)
    try:
        peer.wait_ready(60)

        async def ask() -> tuple[object, object]:
            client, router = DecodePeerClient(control), RouterClient(worker.ingress)
            try:
                await client.ping(timeout_s=10)
                generation = asyncio.ensure_future(client.generate(502, ids, NUM_NEW_TOKENS))
                result = await router.prefill(ids, 502, timeout_s=30)
                return result, await asyncio.wait_for(generation, 30)
            finally:
                client.close()
                router.close()

        result, generation = asyncio.run(ask())
    finally:
        code = peer.stop(30)
    assert result.status is OutcomeStatus.OK
    assert generation.is_ok
    assert list(generation.token_ids) == hf_generate(checkpoint, ids)
    assert code == 0, peer.log_tail()


def test_worker_exits_cleanly_after_the_peer_leaves(worker, decode_peer) -> None:
    decode_peer.close()
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.wait_exit(30) == 0
