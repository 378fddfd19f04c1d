"""A running worker feeds Dynamo's standalone KV indexer (pinned, ``make kv-events-deps``):
after prompts are served, the indexer reports the worker's overlap with a prompt sharing their
prefix, exactly the full pages cached; after the pool's pressure evicted them, it reports none;
once the worker has drained and exited, it holds nothing of it.

The worker is ``prefill-worker serve`` on the tiny test config (page size 4) with KV events on
and a 32-page pool, so that a few more prompts must evict the first; requests go through the
router client and a real decode peer over NIXL. Needs the prefix cache (``kv/page_cache.py``):
without it there is nothing to publish, and the test says so."""

from __future__ import annotations

import importlib.util
import itertools
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.ingress.messages import Result
from prefill_worker.request import OutcomeStatus
from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import PAGE_SIZE, Decode, Worker, free_port, start_worker
from tests.interop.dynamo import DynamoIndexer, dynamo_python
from tests.polling import wait_until

pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(
        importlib.util.find_spec("prefill_worker.kv.page_cache") is None,
        reason="needs prefix cache",
    ),
]

WORKER_ID = 1
NUM_POOL_PAGES = 32
PROMPT_TOKENS = 42  # 10 full pages and 2 tokens: the full pages are cached after the prefill
NUM_FULL_PAGES = PROMPT_TOKENS // PAGE_SIZE


class Serving:
    """The worker, a decode peer and a router: ``serve`` sends one prompt through all three."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.decode = Decode(worker.bootstrap)
        self.router = BlockingRouterClient(worker.ingress)
        self._rooms = itertools.count(1)
        self._pool = ThreadPoolExecutor(1)

    def serve(self, token_ids: list[int]) -> Result:
        """The decode side is driven (``wait``) while the router waits for the result."""
        room = next(self._rooms)
        self.decode.want(room, len(token_ids))
        future = self._pool.submit(self.router.prefill, token_ids, room)
        self.decode.wait([room])
        result = future.result(timeout=60)
        assert result.status is OutcomeStatus.OK, (result, self.worker.log())
        return result

    def close(self) -> None:
        self._pool.shutdown()
        self.router.close()
        self.decode.close()


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Serving]:
    dynamo_python()  # skip before starting anything
    checkpoint = make_checkpoint("llama", tmp_path / "llama")
    worker = start_worker(
        tmp_path,
        checkpoint,
        f"cache.num_pages={NUM_POOL_PAGES}",
        "kv_events.enabled=true",
        f"kv_events.publish_bind=tcp://127.0.0.1:{free_port()}",
        f"kv_events.replay_bind=tcp://127.0.0.1:{free_port()}",
    )
    try:
        worker.child.wait_ready(120)
        started = Serving(worker)
        yield started
        started.close()
    finally:
        worker.child.kill()


@pytest.fixture
def indexer(serving: Serving, tmp_path: Path) -> Iterator[DynamoIndexer]:
    """Subscribed for certain: PUB drops what it sends before the subscription arrives, so
    distinct probe prompts are served until the indexer reports one of them."""
    status, ready = serving.worker.http("/readyz")
    assert status == 200, ready
    publish = json.loads(ready)["kv_events"]
    workdir = tmp_path / "indexer"
    workdir.mkdir()
    started = DynamoIndexer.start(workdir, PAGE_SIZE, {WORKER_ID: publish})
    try:
        for seed in range(1000, 1020):
            probe = prompt(2 * PAGE_SIZE + 1, seed=seed)
            serving.serve(probe)
            if eventually(lambda probe=probe: started.overlap_blocks(probe) == {WORKER_ID: 2}):
                break
        else:
            pytest.fail(f"the indexer never saw the worker's blocks:\n{started.child.log_tail()}")
        yield started
    finally:
        started.close()


def eventually(condition, timeout_s: float = 2.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_indexer_follows_the_worker_cache(serving: Serving, indexer: DynamoIndexer) -> None:
    first = prompt(PROMPT_TOKENS, seed=1)
    serving.serve(first)
    sharing = first[: 6 * PAGE_SIZE] + prompt(20, seed=2)  # shares 6 full pages with `first`
    wait_until(
        lambda: indexer.overlap_blocks([*first, 5, 6, 7]) == {WORKER_ID: NUM_FULL_PAGES},
        30,
        "the worker's cached pages of the first prompt",
    )
    assert indexer.overlap_blocks(sharing) == {WORKER_ID: 6}

    # The pool holds 32 pages; each later prompt needs 11 while it runs and leaves 10 cached.
    # Least recently used idle pages go first, so by the last of these every page of `first`
    # has been evicted (the newest three prompts alone account for 30 cached pages).
    for seed in range(3, 9):
        serving.serve(prompt(PROMPT_TOKENS, seed=seed))
    wait_until(
        lambda: indexer.overlap_blocks(first) == {} and indexer.overlap_blocks(sharing) == {},
        30,
        "the first prompt's pages evicted",
    )
    latest = prompt(PROMPT_TOKENS, seed=8)
    # The indexer applies batches as they arrive: the last prompt's pages may still be coming.
    wait_until(
        lambda: indexer.overlap_blocks(latest) == {WORKER_ID: NUM_FULL_PAGES},
        30,
        "the last prompt's cached pages",
    )

    # A drained worker empties its cache on the way out, and says so before its socket closes.
    assert serving.worker.child.stop() == 0, serving.worker.log()
    wait_until(lambda: not indexer.indexed_block_hashes(), 30, "the worker's blocks cleared")
