"""A forward is never delayed by a copy (issue 17). The engine runs on its own thread over a
real model, a real NIXL backend and a decode in this process; the transfer thread's copies
are held (``GatedAgent``: its ``transfer()`` waits for the test, through the backend's
``poster_factory`` seam). While the first chunk's copy is held the engine still computes
every other chunk of the prompt, and a second request start to finish; once the copies go,
both requests end ok with their KV byte for byte in the decode's pages and every pool whole.
With the copy on the engine thread (main before #17), no step would follow the held copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from prefill_worker.inbox import Inbox
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.model import KVCache, Runner
from prefill_worker.request import Outcome, OutcomeStatus, PrefillRequest, SamplingParams
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from prefill_worker.scheduler.observer import NullObserver
from prefill_worker.testing.random_model import random_runner
from prefill_worker.transfer import KVReceiver, RoomState
from prefill_worker.transfer.native.backend import NixlBackend
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.options import Hooks, NativeOptions, NixlOptions
from tests.integration.transfer.engine_thread import engine_thread
from tests.patience import patient
from tests.polling import wait_until

PAGE_SIZE, CHUNK, NUM_PAGES = 16, 32, 64
MODEL = dict(
    architectures=["LlamaForCausalLM"], vocab_size=500, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


class GatedAgent:
    """The real agent, except that ``transfer()`` (the copy) waits for ``gate``."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.gate = threading.Event()
        self.num_held = 0

    def make_prepped_xfer(self, *args: Any) -> Any:
        return self._agent.make_prepped_xfer(*args)

    def transfer(self, handle: Any) -> str:
        self.num_held += 1
        self.gate.wait(patient(60))  # bounded: a broken test must not hang the suite
        return str(self._agent.transfer(handle))

    def check_xfer_state(self, handle: Any) -> str:
        return str(self._agent.check_xfer_state(handle))


@dataclass
class Steps(NullObserver):
    """Counts forwards the engine ran (steps with tokens)."""

    num_forwards: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def on_step(self, duration_s: float, num_batch_tokens: int) -> None:
        if num_batch_tokens:
            self.num_forwards += 1


@dataclass
class Rig:
    engine: Engine
    agent: GatedAgent
    receiver: KVReceiver
    inbox: Inbox
    steps: Steps
    prefill_kv: KVCache
    decode_kv: KVCache


def tiny_runner(pool_layout: str) -> Runner:
    runner, _ = random_runner(
        MODEL, torch.float32, torch.device("cpu"), "sdpa", PAGE_SIZE, NUM_PAGES, 0, pool_layout
    )
    return runner


@pytest.fixture
def rig(pool_layout: str) -> Iterator[Rig]:
    runner = tiny_runner(pool_layout)
    pages, aux = PagePool(NUM_PAGES), AuxPool(8)
    gated: list[GatedAgent] = []

    def poster(agent: Any) -> PushThread:
        gated.append(GatedAgent(agent))
        return PushThread(gated[0])

    backend = NixlBackend(
        runner.kv_cache.regions(aux.base_addr, aux.num_rows),
        NativeOptions("tcp://127.0.0.1:0", 10.0, 0.1, 10.0, NixlOptions("cadence-prefill")),
        Hooks(poster_factory=poster),
    )
    steps = Steps()
    engine = Engine(
        runner,
        backend,
        EngineKV(pages, aux),
        steps.outcomes.append,
        EngineLimits(
            page_size=PAGE_SIZE,
            chunk_size=CHUNK,
            max_batch_tokens=CHUNK,
            max_running_requests=4,
            bootstrap_timeout_s=30.0,
            transfer_timeout_s=60.0,
        ),
        overlap=True,
        observer=steps,
    )
    decode_kv = tiny_runner(pool_layout).kv_cache
    receiver = KVReceiver.from_tensors(
        decode_kv.k, decode_kv.v, backend.bootstrap_endpoint,
        num_aux_rows=4, pool_layout=pool_layout, io_thread=True,
    )  # fmt: skip
    with engine_thread(engine, (pages, aux), receiver.close, backend.close) as inbox:
        try:
            receiver.wait_registered(10.0)
            yield Rig(engine, gated[0], receiver, inbox, steps, runner.kv_cache, decode_kv)
        finally:
            gated[0].gate.set()  # a held forward or copy must not hold up the stop


def prefill(request_id: str, token_ids: list[int], room: int) -> PrefillRequest:
    return PrefillRequest(request_id, token_ids, SamplingParams(), False, room, time.monotonic())


def test_engine_steps_on_while_a_copy_is_held(rig: Rig) -> None:
    long_prompt = [(7 * i) % 500 for i in range(6 * CHUNK)]  # six chunks, 12 pages
    rig.receiver.want(1, list(range(12)), 0, 0)
    rig.inbox.put(prefill("long", long_prompt, 1))
    wait_until(lambda: rig.agent.num_held >= 1, 30.0, "the first chunk's copy to start")
    # Chunk 1's copy is held on the transfer thread (from before chunk 3 could start: one
    # forward in flight at most); the engine computes chunks 2..6 all the same,
    wait_until(lambda: rig.steps.num_forwards >= 6, 60.0, "the other chunks")
    # and a request that arrives while the copy is still held, start to finish.
    rig.receiver.want(2, [40, 41], 1, 0)
    rig.inbox.put(prefill("short", [(3 * i) % 500 for i in range(20)], 2))
    wait_until(lambda: rig.steps.num_forwards >= 7, 60.0, "the short request's forward")
    assert rig.agent.num_held == 1 and not rig.agent.gate.is_set()
    assert not rig.steps.outcomes  # nothing can finish before its pages are copied
    assert rig.receiver.poll(1).state is RoomState.PENDING
    rig.agent.gate.set()
    wait_until(lambda: len(rig.steps.outcomes) == 2, 60.0, "both outcomes")
    statuses = {o.request_id: o.status for o in rig.steps.outcomes}
    assert statuses == {"long": OutcomeStatus.OK, "short": OutcomeStatus.OK}
    assert rig.receiver.wait(1, 10.0).state is RoomState.DONE
    assert rig.receiver.wait(2, 10.0).state is RoomState.DONE
    pairs = [(rig.decode_kv.k, rig.prefill_kv.k), (rig.decode_kv.v, rig.prefill_kv.v)]
    for decode_views, prefill_views in pairs:
        for landed, computed in zip(decode_views, prefill_views, strict=True):
            for page in [*range(12), 40, 41]:  # each landed page is one the engine computed
                assert landed[page].abs().sum() > 0
                assert any(torch.equal(landed[page], computed[p]) for p in range(NUM_PAGES))
    assert rig.engine.load.num_used_pages == 0 and rig.engine.load.num_used_aux_rows == 0
