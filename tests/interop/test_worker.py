"""The real worker (``prefill-worker serve``, ``transfer.protocol`` sglang or both) with SGLang's
own decode code as the decode and our router client over ZMQ: the KV lands where the decode
asked and matches transformers, the first token lands in its metadata row, SGLang's receiver
says Success; SGLang's decode aborts a room; the worker dies (the decode fails the room by its
heartbeat); the decode dies (the worker fails the request and its pools are whole)."""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.request import FinishReason, OutcomeStatus
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from prefill_worker.transfer import KVReceiver, RoomState
from tests.checkpoints import hf_model, prompt
from tests.integration.daemon.conftest import Worker
from tests.interop.conftest import (
    HEAD_DIM,
    NUM_KV_HEADS,
    Served,
    Version,
    assert_pools_whole,
    launch,
)
from tests.interop.decodes import Landed, SglangDecode, new_room
from tests.polling import wait_until

pytestmark = pytest.mark.interop

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # of the largest |K| or |V| of the prompt


@pytest.fixture(scope="session")
def served(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Served]]:
    """Two workers for every version: page size 16 in fp32 with a page-major pool (SGLang
    only), page size 1 in bf16, layer-major, serving both protocols."""
    tmp_path = tmp_path_factory.mktemp("served")
    workers = {
        "p16-fp32-pm": launch(tmp_path, checkpoint, 16, "float32", "sglang", "page_major"),
        "p1-bf16": launch(tmp_path, checkpoint, 1, "bfloat16", "both"),
    }
    try:
        yield {name: one.ready() for name, one in workers.items()}
        for one in workers.values():
            assert one.worker.child.stop() == 0, one.worker.log()
    finally:
        for one in workers.values():
            one.worker.child.kill()


@pytest.fixture
def router() -> Iterator[Callable[[Worker], BlockingRouterClient]]:
    clients: list[BlockingRouterClient] = []

    def connect(worker: Worker) -> BlockingRouterClient:
        clients.append(BlockingRouterClient(worker.ingress))
        return clients[-1]

    yield connect
    for client in clients:
        client.close()


def hf_kv(checkpoint: Path, ids: list[int]) -> tuple[int, list[tuple[torch.Tensor, ...]]]:
    """transformers' greedy first token, and K and V per layer: ``[tokens, heads, dim]``."""
    with torch.no_grad():
        out = hf_model(checkpoint)(torch.tensor([ids]), use_cache=True)
    kv = [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        for layer in out.past_key_values.layers
    ]
    return int(out.logits[0, -1].argmax()), kv


def tokens(raw: np.ndarray, dtype: str, num_tokens: int) -> torch.Tensor:
    """Landed page bytes ``[pages, page_bytes]`` as ``[tokens, heads, dim]`` fp32."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    values = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch_dtype).float()
    return values.view(-1, NUM_KV_HEADS, HEAD_DIM)[:num_tokens]


def check_landed(landed: Landed, served: Served, checkpoint: Path, ids: list[int], held: int):
    """Tokens from ``held`` on match transformers; the held pages were not written."""
    lay = served.layout
    _, reference = hf_kv(checkpoint, ids)
    num_held_pages = held // lay.page_size
    for layer, (k_ref, v_ref) in enumerate(reference):
        for got_raw, ref in ((landed.k[layer], k_ref), (landed.v[layer], v_ref)):
            assert (got_raw[:num_held_pages] == FILL_BYTE).all(), "a held page was written"
            got = tokens(got_raw, lay.dtype, len(ids))
            atol = TOLERANCE[lay.dtype] * float(ref.abs().max())
            torch.testing.assert_close(got[held:], ref[held:], atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["p16-fp32-pm", "p1-bf16"])
def test_kv_and_first_token_land_where_the_decode_asked(
    decode_process: SglangDecodeProcess, served, router, checkpoint, tmp_path: Path, name: str
) -> None:
    one = served[name]
    decode = SglangDecode(decode_process, one.sglang, one.layout)
    client = router(one.worker)
    rooms = {  # room: (prompt, tokens the decode holds)
        new_room(): (prompt(70, seed=1), 0),  # several chunks
        new_room(): (prompt(45, seed=2), 32),  # a decode-held prefix
        new_room(): (prompt(17, seed=3), 0),
    }
    for room, (ids, held) in rooms.items():
        decode.want(room, len(ids), held)
    with ThreadPoolExecutor(len(rooms)) as pool:
        futures = {
            room: pool.submit(client.prefill, ids, room, return_logprob=True)
            for room, (ids, _) in rooms.items()
        }
        results = {room: future.result(timeout=60) for room, future in futures.items()}
    for room, (ids, held) in rooms.items():
        result = results[room]
        assert result.status is OutcomeStatus.OK, result
        assert result.num_cached_tokens == held
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        check_landed(landed, one, checkpoint, ids, held)
        assert landed.output_ids[0] == result.first_token_id
        assert landed.logprob_idx[0] == result.first_token_id
        assert landed.logprob_val[0] == pytest.approx(result.first_token_logprob, abs=1e-6)
        assert landed.cached_tokens[0] == (result.num_prefix_hit_tokens or 0)
        assert int(landed.bootstrap_room[0]) == room
        if one.layout.dtype == "float32":
            assert result.first_token_id == hf_kv(checkpoint, ids)[0]


def test_native_decodes_are_served_beside_sglang_ones(
    decode_process: SglangDecodeProcess, served, router, tmp_path: Path
) -> None:
    """``protocol: both``: a native KVReceiver and an SGLang decode, one worker, same time."""
    one = served["p1-bf16"]
    sglang = SglangDecode(decode_process, one.sglang, one.layout)
    lay = one.layout
    shape = (lay.num_pages, lay.page_size, lay.num_kv_heads, lay.head_dim)
    ks = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(lay.num_layers)]
    vs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(lay.num_layers)]
    native = KVReceiver.from_tensors(ks, vs, one.worker.bootstrap, num_aux_rows=4)
    try:
        native.wait_registered(timeout_s=30)
        client = router(one.worker)
        ids = prompt(30, seed=9)
        room_native, room_sglang = new_room(), new_room()
        native.want(room_native, list(range(1, 1 + len(ids))), 0, 0)
        sglang.want(room_sglang, len(ids))
        with ThreadPoolExecutor(2) as pool:
            rooms = (room_native, room_sglang)
            futures = [pool.submit(client.prefill, ids, room) for room in rooms]

            def native_done() -> bool:
                native.progress()
                return native.poll(room_native).state is not RoomState.PENDING

            wait_until(native_done, 60, "the native room")
            assert all(f.result(timeout=60).status is OutcomeStatus.OK for f in futures)
        assert native.poll(room_native).state is RoomState.DONE
        assert sglang.wait(room_sglang) == ("Success", None)
        for layer in range(lay.num_layers):  # the same bytes through both protocols
            landed = sglang.landed(room_sglang, tmp_path)
            got = tokens(landed.k[layer], lay.dtype, len(ids))
            assert torch.equal(got, ks[layer][1 : 1 + len(ids), 0].float())
    finally:
        native.close()


def test_sglang_decode_aborts_a_room(
    decode_process: SglangDecodeProcess, served, router, checkpoint
) -> None:
    one = served["p16-fp32-pm"]
    decode = SglangDecode(decode_process, one.sglang, one.layout)
    room = new_room()
    decode.want(room, 40)
    decode.abort(room)
    wait_until(lambda: decode.acked(room), 20, "ABORT_ACK at the decode")
    result = router(one.worker).prefill(prompt(40, seed=4), room)
    assert (result.status, result.reason) == (OutcomeStatus.ABORTED, FinishReason.ABORTED_BY_DECODE)
    assert decode.state(room)[0] == "Failed"  # SGLang's own verdict for an aborted room
    assert_pools_whole(one.worker)


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "router-first"])
def test_a_refused_decode_fails_the_routers_request_at_once(
    decode_process: SglangDecodeProcess, served, router, decode_first: bool
) -> None:
    """A bf16 decode against an fp32 worker: its registration is refused, and the request for
    its room fails with that reason at once, not after the bootstrap timeout (5 s here)."""
    one = served["p16-fp32-pm"]
    bf16 = dataclasses.replace(one.layout, dtype="bfloat16")
    decode = SglangDecode(decode_process, one.sglang, bf16)
    client, room, ids = router(one.worker), new_room(), prompt(40, seed=6)
    with ThreadPoolExecutor(1) as pool:
        if decode_first:
            decode.want(room, len(ids))
            assert decode.wait(room, 10)[0] == "Failed"  # the worker has heard it
        start = time.monotonic()
        future = pool.submit(client.prefill, ids, room)
        if not decode_first:
            decode.want(room, len(ids))
        result = future.result(timeout=30)
        elapsed_s = time.monotonic() - start
    assert result.status is OutcomeStatus.FAILED, result
    assert "registration refused" in str(result.error), result
    assert elapsed_s < 2.5, f"{elapsed_s:.1f} s: the request waited for its bootstrap timeout"
    state, reason = decode.wait(room, 10)
    assert state == "Failed" and "registration refused" in str(reason), (state, reason)


def test_worker_dies_and_the_decode_fails_the_room_by_heartbeat(
    decode_process: SglangDecodeProcess, version: Version
) -> None:
    one = version.doomed_worker.ready()
    decode = SglangDecode(decode_process, one.sglang, one.layout)
    room = new_room()
    decode.want(room, 40)  # bootstrapped and waiting for its KV
    assert decode.state(room)[0] != "Failed"
    one.worker.proc.send_signal(signal.SIGKILL)
    one.worker.wait_exit(10)
    state, reason = decode.wait(room, timeout_s=30)
    assert state == "Failed" and "Lost connection with prefill" in str(reason), (state, reason)


def test_decode_dies_and_the_worker_pools_are_whole(
    decode_process: SglangDecodeProcess, served, router
) -> None:
    """Last for each version: it kills the version's decode process, with every decode it
    made registered with the workers."""
    one = served["p16-fp32-pm"]
    decode = SglangDecode(decode_process, one.sglang, one.layout)
    room = new_room()
    decode.want(room, 300)  # registered and asked: the worker will push into a dead pool
    decode_process.kill()
    result = router(one.worker).prefill(prompt(300, seed=5), room)
    assert result.status is OutcomeStatus.FAILED, result
    assert_pools_whole(one.worker)  # and the next version's tests use these workers
