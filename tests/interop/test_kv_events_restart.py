"""Dynamo's standalone KV indexer (pinned, ``make kv-events-deps``) follows the worker across a
restart, SIGTERM or SIGKILL, on the same KV-event ports: it forgets what the previous run held
and scores each prompt exactly as the new run's prefix cache hits it.

Dynamo 1.6.1 ignores every batch whose sequence number is at or below the last it applied, so
this holds only because each run numbers its batches from its start time in microseconds
(``kv_events/publisher.py``); a run that counted from 0 again went unheard until its numbers
passed the old run's (after a SIGKILL the indexer kept the dead run's blocks all that time)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint, prompt
from tests.integration.daemon.conftest import PAGE_SIZE, free_port, start_worker
from tests.interop.dynamo import DynamoIndexer, dynamo_python
from tests.interop.test_worker_feeds_dynamo_indexer import Serving
from tests.polling import wait_until

pytestmark = [pytest.mark.interop]

WORKER_ID = 1
PROMPT_TOKENS = 42  # 10 full pages and 2 tokens
NUM_SHARED_PAGES = 6


class Restarts:
    """Runs of one worker on the same KV-event ports (new ingress and bootstrap ports each)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.checkpoint = make_checkpoint("llama", tmp_path / "llama")
        self.binds = (
            "cache.num_pages=64",
            "kv_events.enabled=true",
            f"kv_events.publish_bind=tcp://127.0.0.1:{free_port()}",
            f"kv_events.replay_bind=tcp://127.0.0.1:{free_port()}",
        )
        self.run: Serving | None = None

    def start(self) -> Serving:
        worker = start_worker(self.tmp_path, self.checkpoint, *self.binds)
        try:
            worker.child.wait_ready(120)
        except BaseException:
            worker.child.kill()
            raise
        self.run = Serving(worker)
        return self.run

    def end(self, how: str) -> None:
        assert self.run is not None
        run, self.run = self.run, None
        run.close()
        if how == "SIGKILL":
            run.worker.child.kill()
        else:
            assert run.worker.child.stop() == 0, run.worker.log()

    def close(self) -> None:
        if self.run is not None:
            self.end("SIGKILL")


@pytest.fixture
def restarts(tmp_path: Path) -> Iterator[Restarts]:
    dynamo_python()  # skip before starting anything
    started = Restarts(tmp_path)
    yield started
    started.close()


def subscribe(run: Serving, tmp_path: Path) -> DynamoIndexer:
    """The indexer with the worker registered as the docs say, replay socket included: the
    first batch it hears (the worker sends one every second when idle) shows it a gap from 0,
    and it fetches what it missed, so no probe prompts are needed."""
    status, ready = run.worker.http("/readyz")
    assert status == 200, ready
    endpoints = json.loads(ready)
    workdir = tmp_path / "indexer"
    workdir.mkdir()
    return DynamoIndexer.start_registered(
        workdir, PAGE_SIZE, WORKER_ID, endpoints["kv_events"], endpoints["kv_events_replay"]
    )


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_the_indexer_follows_the_worker_across_a_restart(
    restarts: Restarts, tmp_path: Path, how: str
) -> None:
    """Requests reach the new run as soon as it is ready, as they would from a router: its
    first blocks go out before the indexer has reconnected (Dynamo retries with a backoff of
    up to seconds), and come to it through the replay socket."""
    first = restarts.start()
    indexer = subscribe(first, tmp_path)
    try:
        old = prompt(PROMPT_TOKENS, seed=1)
        first.serve(old)
        num_full_pages = PROMPT_TOKENS // PAGE_SIZE
        wait_until(
            lambda: indexer.overlap_blocks(old) == {WORKER_ID: num_full_pages},
            30,
            "the first run's pages",
        )

        restarts.end(how)
        second = restarts.start()
        ready_at = time.monotonic()
        fresh = prompt(PROMPT_TOKENS, seed=2)
        assert second.serve(fresh).num_prefix_hit_tokens == 0
        sharing = fresh[: NUM_SHARED_PAGES * PAGE_SIZE] + prompt(10, seed=3)
        wait_until(
            lambda: (
                indexer.overlap_blocks(old) == {}
                and indexer.overlap_blocks(sharing) == {WORKER_ID: NUM_SHARED_PAGES}
            ),
            30,
            f"the old run forgotten, the new run's pages known:\n{indexer.child.log_tail()}",
        )
        print(f"{how}: the indexer caught up {time.monotonic() - ready_at:.2f} s after READY")
        # The indexer's scores are what the worker's prefix cache then hits.
        assert second.serve(sharing).num_prefix_hit_tokens == NUM_SHARED_PAGES * PAGE_SIZE
        assert indexer.overlap_blocks(old) == {}
        assert second.serve(old).num_prefix_hit_tokens == 0
    finally:
        indexer.close()
