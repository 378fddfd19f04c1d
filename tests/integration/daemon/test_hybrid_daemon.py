"""A hybrid checkpoint (Qwen3.5, Qwen3-Next) in the real daemon with native decodes (the decode
SDK, real NIXL): the worker publishes its full-attention layers as the KV layout and its
linear layers' state component (``describe_state``); a decode that registers a state pool
beside its KV pool receives, per room, the full layers' K/V in its pages and every linear
layer's conv and recurrent state after the whole prompt in the slot its ``want`` named,
equal to transformers' within 1e-4: three prompts at once (batched), each longer than a chunk
(chunked), into scattered pages and slots. A decode that registers no state pool is refused
with a typed reason (``state_unsupported``) and gets no byte. Afterwards every aux row (state
slot) and page is back and the worker drains to exit 0. The same from a worker at TP 2
(Qwen3-Next): each rank writes its KV head, the leader the slots it gathered whole."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.state_layout import StateComponent
from prefill_worker.kv_events.wire import END_OF_REPLAY_SEQ, seq_frame
from prefill_worker.request import FinishReason, OutcomeStatus
from prefill_worker.transfer import (
    KVReceiver,
    RoomState,
    describe_state,
    describe_worker,
    state_regions_from_tensors,
)
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import (
    DECODE_PAGES,
    PAGE_SIZE,
    Decode,
    Worker,
    decode_pool,
    start_worker,
    wait_until,
)
from tests.patience import patient

TOL = 1e-4
FULL_LAYERS, LINEAR_LAYERS = (1, 4), (0, 2, 3)  # tests/checkpoints.py: the hybrids' layer_types
NUM_STATE_SLOTS = 6
PROMPTS = {5301: 37, 5302: 50, 5303: 23}  # room: prompt tokens (chunks are 16)
STATE_SLOTS = {5301: 4, 5302: 1, 5303: 5}


class StateDecode(Decode):
    """A decode with a state pool of the worker's component: per linear layer, conv and
    recurrent ``[NUM_STATE_SLOTS, *item_shape]``, zeros."""

    def __init__(self, bootstrap: str) -> None:
        layout = describe_worker(bootstrap, 30.0)
        (component,) = describe_state(bootstrap, 30.0)
        self.component: StateComponent = component
        self.k, self.v = decode_pool(
            layout.kind, layout.num_kv_heads, layout.head_dim, layout.num_layers
        )
        self.state = [
            [
                torch.zeros((NUM_STATE_SLOTS, *t.item_shape), dtype=getattr(torch, t.dtype))
                for _ in component.layer_ids
            ]
            for t in component.tensors
        ]
        regions = state_regions_from_tensors(component, self.state)
        self.receiver = KVReceiver.from_tensors(
            self.k, self.v, bootstrap, num_aux_rows=8, state=regions
        )
        self.receiver.wait_registered(timeout_s=patient(30))
        self._next_page, self._next_slot, self.rooms = DECODE_PAGES - 1, 0, {}

    def want_state(self, room: int, num_tokens: int, state_slot: int) -> None:
        count = -(-num_tokens // PAGE_SIZE)
        pages = [self._next_page - 2 * i for i in range(count)]  # scattered
        self._next_page -= 2 * count
        aux_slot, self._next_slot = self._next_slot, self._next_slot + 1
        self.rooms[room] = (pages, aux_slot)
        self.receiver.want(room, pages, aux_slot, 0, state_slot=state_slot)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_native_decode_receives_kv_and_state(tmp_path: Path, family: str) -> None:
    checkpoint = make_checkpoint(family, tmp_path / family)
    settings = (
        "cache.num_pages=64",
        "cache.num_aux_rows=4",
        "cache.prefix_caching=true",
        "kv_events.enabled=true",
        "kv_events.publish_bind=tcp://127.0.0.1:0",
        "kv_events.replay_bind=tcp://127.0.0.1:0",
    )
    worker = start_worker(tmp_path, checkpoint, *settings)
    try:
        worker.child.wait_ready(120)
        router = BlockingRouterClient(worker.ingress)
        serve_prompts_and_check(worker, router, checkpoint)
        refuse_a_decode_without_state(worker, router)
        router.close()
        wait_until(lambda: pools_whole(worker), 30, "every aux row (state slot) and page back")
        events = published_events(worker)  # the run's first batch clears, then nothing stored
        assert events and all(event == {"type": "AllBlocksCleared"} for event in events)
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def test_a_tp2_worker_sends_whole_state_slots(tmp_path: Path) -> None:
    """At TP 2 each rank holds one of the 2 linear key heads (with its 3 value heads) and one
    of the 2 KV heads; both ranks write their KV head into a native decode of TP 1, and the
    leader sends each request's state slot whole (gathered from both ranks when the prompt
    ended, ``model.state_gather``): what a TP-1 worker sends, within 1e-4 of transformers'.
    The refused decode's room, the pools and the drain as at TP 1."""
    checkpoint = make_checkpoint("qwen3_next", tmp_path / "qwen3_next")
    settings = ("cache.num_pages=64", "cache.num_aux_rows=4", "parallel.tp_size=2")
    worker = start_worker(tmp_path, checkpoint, *settings)
    try:
        worker.child.wait_ready(120)
        router = BlockingRouterClient(worker.ingress)
        serve_prompts_and_check(worker, router, checkpoint)
        refuse_a_decode_without_state(worker, router)
        router.close()
        wait_until(lambda: pools_whole(worker), 30, "every aux row (state slot) and page back")
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def serve_prompts_and_check(worker: Worker, router: BlockingRouterClient, checkpoint: Path) -> None:
    """``PROMPTS`` at once (batched, chunked) into a state decode's scattered pages and slots:
    each room's full layers' K/V and linear layers' state equal transformers', the slots no
    room named untouched."""
    decode = StateDecode(worker.bootstrap)
    assert len(decode.k) == 2  # the KV list: the 2 full-attention layers of 5
    assert decode.component.layer_ids == LINEAR_LAYERS
    assert [t.name for t in decode.component.tensors] == ["conv", "recurrent"]
    prompts = {room: prompt(n, seed=room) for room, n in PROMPTS.items()}
    for room, ids in prompts.items():
        decode.want_state(room, len(ids), STATE_SLOTS[room])
    with ThreadPoolExecutor(len(prompts)) as pool:
        sent = {r: pool.submit(router.prefill, ids, r, timeout_s=60) for r, ids in prompts.items()}
        statuses = decode.wait(list(prompts))
        results = {room: future.result(60) for room, future in sent.items()}
    model = hf_model(checkpoint)
    for room, ids in prompts.items():
        assert results[room].status is OutcomeStatus.OK, results[room]
        assert statuses[room].state is RoomState.DONE, statuses[room]
        check_against_transformers(model, decode, room, ids)
    untouched = set(range(NUM_STATE_SLOTS)) - set(STATE_SLOTS.values())
    for per_layer in decode.state:
        assert all(not torch.any(t[slot]) for t in per_layer for slot in untouched)
    decode.close()


def check_against_transformers(
    model: torch.nn.Module, decode: StateDecode, room: int, ids: list[int]
) -> None:
    with torch.no_grad():
        layers = model(torch.tensor([ids]), use_cache=True).past_key_values.layers
    for pool_layer, layer in enumerate(FULL_LAYERS):
        k, v = decode.kv(room, len(ids), pool_layer)
        torch.testing.assert_close(k, layers[layer].keys[0].transpose(0, 1), atol=TOL, rtol=0)
        torch.testing.assert_close(v, layers[layer].values[0].transpose(0, 1), atol=TOL, rtol=0)
    conv, recurrent = decode.state
    slot = STATE_SLOTS[room]
    for slot_layer, layer in enumerate(LINEAR_LAYERS):
        expected_conv = layers[layer].conv_states[0][0, :, 1:]
        torch.testing.assert_close(conv[slot_layer][slot], expected_conv, atol=TOL, rtol=0)
        expected = layers[layer].recurrent_states[0][0]
        torch.testing.assert_close(recurrent[slot_layer][slot], expected, atol=TOL, rtol=0)


def refuse_a_decode_without_state(worker: Worker, router: BlockingRouterClient) -> None:
    """A decode with a KV pool only: its room fails ``state_unsupported``, nothing written."""
    decode = Decode(worker.bootstrap)
    ids = prompt(29, seed=5304)
    decode.want(5304, len(ids))
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(router.prefill, ids, 5304, timeout_s=60)
        status = decode.wait([5304])[5304]
        result = sent.result(60)
    assert result.status is OutcomeStatus.FAILED, result
    assert result.reason is FinishReason.TRANSFER_FAILED
    assert str(result.error).startswith("state_unsupported: the decode registered no")
    assert status.state is RoomState.FAILED and "state_unsupported" in str(status.reason)
    assert all(not torch.any(layer) for layer in decode.k)
    decode.close()


def published_events(worker: Worker) -> list[dict[str, object]]:
    """Every event the worker published so far, from its replay socket (oldest first)."""
    endpoint = json.loads(worker.http("/readyz")[1])["kv_events_replay"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", seq_frame(0)])
        events: list[dict[str, object]] = []
        while True:
            assert sock.poll(int(patient(10) * 1000)), "no replay answer"
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == END_OF_REPLAY_SEQ:
                return events
            events += msgspec.msgpack.decode(payload)[1]
    finally:
        sock.close(linger=0)
        ctx.term()


def pools_whole(worker: Worker) -> bool:
    """The aux rows are the state slots: all back, and every page."""
    metrics = worker.http("/metrics")[1]
    used = ("prefill_worker_aux_rows_used 0.0", "prefill_worker_kv_pages_used 0.0")
    return all(line in metrics.splitlines() for line in used)
