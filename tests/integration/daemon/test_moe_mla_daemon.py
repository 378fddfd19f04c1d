"""The mixture-of-experts families through the real worker process (``qwen3_moe``, and
``deepseek_v3`` with its ``mla`` pool), one worker per family: a chunked prompt (longer than
the 16-token chunk) with prompt logprobs, then a prefix-cache hit on the same prompt's start,
return transformers' first token, its logprob and the prompt logprobs (fp32, 1e-4); the worker
publishes a KV event for every full page its cache stores (the prompt's block-hash chain, the
pool's page size as the block size) and removes them when the small pool evicts them.

Events are read back from the replay socket (from sequence 0: everything held), so no
subscription can miss the first batch."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.ingress.messages import Result, unpack_logprobs
from prefill_worker.kv.block_hash import block_hashes
from prefill_worker.kv_events.wire import (
    END_OF_REPLAY_SEQ,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    seq_frame,
)
from prefill_worker.request import OutcomeStatus
from tests.checkpoints import MOE_FAMILIES, hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import PAGE_SIZE, Decode, Worker, start_worker, wait_until
from tests.patience import patient

NUM_POOL_PAGES = 32
A = prompt(42, seed=2801)  # 3 chunks; 10 full pages cached after it
B = [*A[:30], *prompt(12, seed=2802)]  # shares 7 full pages with A


@dataclass
class Serving:
    worker: Worker
    checkpoint: Path
    decode: Decode
    router: BlockingRouterClient
    replay: str
    kind: str  # vLLM's kind of the model's KV-cache group: what its events name

    def serve(self, ids: list[int], room: int, logprob_start_len: int | None = None) -> Result:
        self.decode.want(room, len(ids))
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                self.router.prefill,
                ids,
                room,
                return_logprob=True,
                logprob_start_len=logprob_start_len,
                timeout_s=60,
            )
            self.decode.wait([room])
            result = sent.result(60)
        assert result.status is OutcomeStatus.OK, (result, self.worker.log())
        return result

    def events(self) -> list[KVEvent]:
        """Every event the worker still holds for replay, oldest first."""
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay)
            dealer.send_multipart([b"", seq_frame(0)])
            events: list[KVEvent] = []
            while True:
                assert dealer.poll(int(patient(10.0) * 1000)), "no replay answer"
                _, _, seq, payload = dealer.recv_multipart()
                if seq == END_OF_REPLAY_SEQ:
                    return events
                events += msgspec.msgpack.decode(payload, type=KVEventBatch).events


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def serving(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    family = request.param
    tmp_path = tmp_path_factory.mktemp(family)
    checkpoint = make_checkpoint(family, tmp_path / family)
    worker = start_worker(
        tmp_path,
        checkpoint,
        f"cache.num_pages={NUM_POOL_PAGES}",
        "kv_events.enabled=true",
        "kv_events.publish_bind=tcp://127.0.0.1:0",
        "kv_events.replay_bind=tcp://127.0.0.1:0",
    )
    try:
        worker.child.wait_ready(120)
        status, ready = worker.http("/readyz")
        assert status == 200, ready
        replay = json.loads(ready)["kv_events_replay"]
        decode, router = Decode(worker.bootstrap), BlockingRouterClient(worker.ingress)
        kind = "mla_attention" if family == "deepseek_v3" else "full_attention"
        yield Serving(worker, checkpoint, decode, router, replay, kind)
        router.close()
        decode.close()
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def hf_logprobs(checkpoint: Path, ids: list[int]) -> tuple[int, float, list[float]]:
    """transformers' greedy first token, its logprob, and each prompt token's logprob."""
    with torch.no_grad():
        logits = hf_model(checkpoint)(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    first = int(logprobs[-1].argmax())
    prompt_lp = [float(logprobs[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    return first, float(logprobs[-1, first]), prompt_lp


def check_against_hf(serving: Serving, ids: list[int], result: Result, start: int) -> None:
    first, first_lp, prompt_lp = hf_logprobs(serving.checkpoint, ids)
    assert result.first_token_id == first
    assert result.first_token_logprob == pytest.approx(first_lp, abs=1e-4)
    assert isinstance(result.prompt_logprobs, bytes)
    got = list(unpack_logprobs(result.prompt_logprobs))
    assert got == pytest.approx(prompt_lp[start:], abs=1e-4)


def stored_chain(events: list[KVEvent], kind: str) -> dict[int, tuple[int | None, list[int]]]:
    """block hash -> (its parent, its tokens), over every stored event (block size checked, and
    the model's one KV-cache group, of ``kind``)."""
    chain: dict[int, tuple[int | None, list[int]]] = {}
    for event in events:
        if not isinstance(event, BlockStored):
            continue
        assert event.block_size == PAGE_SIZE
        assert (event.group_idx, event.kv_cache_spec_kind) == (0, kind)  # vLLM's names
        parent, tokens = event.parent_block_hash, event.token_ids
        assert len(tokens) == PAGE_SIZE * len(event.block_hashes)
        for i, digest in enumerate(event.block_hashes):
            chain[digest] = (parent, tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
            parent = digest
    return chain


def assert_stored(serving: Serving, ids: list[int]) -> None:
    """Every full page of ``ids`` was reported stored, chained to the one before it."""
    hashes = block_hashes(ids, PAGE_SIZE)
    wait_until(
        lambda: set(hashes) <= set(stored_chain(serving.events(), serving.kind)),
        30,
        "the prompt's stored blocks",
    )
    chain = stored_chain(serving.events(), serving.kind)
    for i, digest in enumerate(hashes):
        parent, tokens = chain[digest]
        assert parent == (hashes[i - 1] if i else None)
        assert tokens == ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]


def removed(serving: Serving) -> set[int]:
    events = serving.events()
    return {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}


def test_chunked_prompt_logprobs_prefix_hit_and_kv_events(serving: Serving) -> None:
    rooms = itertools.count(2801)
    result = serving.serve(A, next(rooms), logprob_start_len=0)
    assert (result.num_prefix_hit_tokens, result.num_computed_tokens) == (0, len(A))
    check_against_hf(serving, A, result, 0)
    assert_stored(serving, A)

    # A hit is capped at logprob_start_len: 28 tokens (7 pages) come from the cache.
    result = serving.serve(B, next(rooms), logprob_start_len=29)
    assert (result.num_prefix_hit_tokens, result.num_computed_tokens) == (28, len(B) - 28)
    check_against_hf(serving, B, result, 29)
    assert_stored(serving, B)

    # 32 pages: each later prompt needs 11 while it runs and leaves 10 cached, least recently
    # used idle pages go first; by the last of these every page of A and B has been evicted.
    for seed in range(2803, 2809):
        serving.serve(prompt(len(A), seed=seed), next(rooms))
    gone = set(block_hashes(A, PAGE_SIZE)) | set(block_hashes(B, PAGE_SIZE))
    wait_until(lambda: gone <= removed(serving), 30, "A's and B's blocks removed")
