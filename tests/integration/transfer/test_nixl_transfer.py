"""Real NIXL between processes (CPU memory over UCX): bytes land exactly where the decode peer
asked, and every failure (kill, freeze, silence, bad frames, mismatch, abort) ends cleanly."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import zmq

from prefill_worker.kv.aux import AUX_ROW_BYTES, AuxRow
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from tests.integration.transfer.conftest import PEER_TIMEOUT_S, Worker, small_spec
from tests.integration.transfer.peers import layer_page

SLACK_S = 1.5
SHORT_WANT_TIMEOUT_S = 1.0  # a worker of its own: the module's waits long for requests


def expected_pool(worker: Worker, before: np.ndarray, moves: list[tuple[int, int]]) -> np.ndarray:
    """The decode pool after copying local page s to decode page d, K and V of every layer."""
    lay = worker.spec.layout
    out = before.copy()
    for layer in range(lay.num_layers):
        for kv in (0, 1):
            for s, d in moves:
                layer_page(out, lay, layer, kv, d)[:] = layer_page(worker.pool, lay, layer, kv, s)
    return out


def push(
    worker: Worker,
    decode,
    room: int,
    num_tokens: int,
    cached: int,
    dst: list[int],
    src: list[int],
    chunk_pages: int,
    slot: int,
    want_first: bool,
) -> AuxRow:
    """One request end to end: want and request in either order, chunked pages, the aux row."""
    if want_first:
        assert decode.call("want", room, dst, slot, cached) == "ok"
    sender = worker.backend.create_sender(room, f"req-{room}", num_tokens)
    if not want_first:
        assert sender.poll() is KVPoll.BOOTSTRAPPING
        assert decode.call("want", room, dst, slot, cached) == "ok"
    assert worker.drive(lambda: sender.poll() is KVPoll.READY)
    assert sender.num_cached_tokens() == cached
    for first in range(0, len(src), chunk_pages):
        sender.send_pages(src[first : first + chunk_pages], first)
    aux = AuxRow(1000 + room % 1000, -0.5, num_tokens, cached)
    row = worker.finish(sender, aux)
    assert decode.call("wait", room, 5.0) == ("done", None)
    sender.close()  # only then may pages and the aux row be reused
    worker.aux.free(row)
    return aux


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_byte_lands_where_decode_asked(workers, decodes, dtype: str) -> None:
    worker = workers[dtype]
    decode = decodes(worker)
    assert decode.call("registered", 10.0) is None
    lay = worker.spec.layout
    rng = np.random.default_rng(7)
    cases = [  # (prompt tokens, cached tokens, contiguous?, want first?)
        (37, 8, False, True),  # 10 pages, 2 cached: scattered map, partial last page
        (40, 0, True, False),  # 10 pages: contiguous runs on both sides
        (13, 12, False, False),  # only the last page is new
    ]
    owned = worker.alloc(lay.num_pages)  # the test picks its own maps among them
    for i, (num_tokens, cached, contiguous, want_first) in enumerate(cases):
        num_pages = -(-num_tokens // lay.page_size)
        num_new = num_pages - cached // lay.page_size
        if contiguous:
            src = owned[3 : 3 + num_pages]
            dst = list(range(11, 11 + num_new))
        else:
            src = [int(p) for p in rng.choice(owned, num_pages, replace=False)]
            dst = [int(p) for p in rng.choice(lay.num_pages, num_new, replace=False)]
        before = decode.pool.copy()
        slot = i + 1
        room = int(rng.integers(1, 2**63))
        aux = push(worker, decode, room, num_tokens, cached, dst, src, 4, slot, want_first)
        moves = list(zip(src[cached // lay.page_size :], dst, strict=True))
        kv_bytes = lay.pool_bytes
        want_pool = expected_pool(worker, before, moves)
        assert np.array_equal(decode.pool[:kv_bytes], want_pool[:kv_bytes]), (dtype, i)
        aux_at = kv_bytes + slot * AUX_ROW_BYTES
        assert AuxRow.unpack(decode.pool[aux_at : aux_at + AUX_ROW_BYTES].tobytes()) == aux
        others = np.ones(len(decode.pool), bool)
        others[aux_at : aux_at + AUX_ROW_BYTES] = False
        others[:kv_bytes] = False
        assert np.array_equal(decode.pool[others], before[others])
    worker.pages.free(owned)
    worker.check_whole()


def ready_sender(worker: Worker, decode, room: int, num_tokens: int = 32):
    """A sender bound to the decode peer's want for 8 pages at decode pages 0..7."""
    assert decode.call("registered", 10.0) is None
    assert decode.call("want", room, list(range(8)), 0, 0) == "ok"
    sender = worker.backend.create_sender(room, f"req-{room}", num_tokens)
    assert worker.drive(lambda: sender.poll() is KVPoll.READY)
    return sender


def wait_failed(
    worker: Worker, sender, within_s: float, ends: tuple[KVPoll, ...] = (KVPoll.PEER_LOST,)
) -> float:
    """The decode is gone or frozen: its request ends (PEER_LOST: dropped by the heartbeat
    check) within the peer timeout."""
    start = time.monotonic()
    assert worker.drive(lambda: sender.poll().is_terminal, within_s)
    assert sender.poll() in ends, sender.failure_reason()
    return time.monotonic() - start


def test_decode_killed_mid_transfer(workers, decodes) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    sender = ready_sender(worker, decode, room=101)
    pages = worker.alloc(8)
    sender.send_pages(pages[:4], 0)
    decode.signal(signal.SIGKILL)
    decode.proc.join(5)
    sender.send_pages(pages[4:], 4)
    # NIXL may see the disconnect first (the write fails) or the heartbeat check may
    ends = (KVPoll.FAILED, KVPoll.PEER_LOST)
    wait_failed(worker, sender, PEER_TIMEOUT_S + SLACK_S, ends)
    reason = sender.failure_reason() or ""
    assert "DISCONNECT" in reason or "silent" in reason
    sender.close()
    worker.pages.free(pages)
    worker.check_whole()


def test_frozen_decode_hits_the_deadline(workers, decodes) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    sender = ready_sender(worker, decode, room=102)
    decode.signal(signal.SIGSTOP)
    pages = worker.alloc(8)
    sender.send_pages(pages[:4], 0)
    elapsed = wait_failed(worker, sender, PEER_TIMEOUT_S + SLACK_S)
    assert elapsed <= PEER_TIMEOUT_S + SLACK_S
    assert "silent" in (sender.failure_reason() or "") or "flight" in (
        sender.failure_reason() or ""
    )
    start = time.monotonic()
    sender.close()
    assert time.monotonic() - start < 1.0
    worker.pages.free(pages)
    worker.check_whole()


def test_decode_never_sends_want(workers, decodes) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    assert decode.call("registered", 10.0) is None
    sender = worker.backend.create_sender(103, "req-103", 32)
    assert not worker.drive(lambda: sender.poll() is not KVPoll.BOOTSTRAPPING, 0.3)
    sender.fail("bootstrap timeout: the decode peer never sent want")  # the scheduler's deadline
    sender.close()
    worker.check_whole()
    # Its want arriving late learns why, not "never arrived".
    assert decode.call("want", 103, list(range(8)), 0, 0) == "ok"
    state, reason = decode.call("wait", 103, 3.0)
    assert state == "failed" and "bootstrap timeout" in reason
    # Failed but not yet closed when the want comes: told at once.
    sender = worker.backend.create_sender(110, "req-110", 32)
    sender.fail("prompt too long")
    assert decode.call("want", 110, list(range(8)), 0, 0) == "ok"
    assert decode.call("wait", 110, 3.0) == ("failed", "prompt too long")
    sender.close()
    # A want that does not fit the prompt fails both sides with the reason.
    sender = worker.backend.create_sender(111, "req-111", 32)
    assert decode.call("want", 111, list(range(5)), 0, 0) == "ok"
    state, reason = decode.call("wait", 111, 3.0)
    assert state == "failed" and "the prompt needs 8" in reason
    assert sender.poll() is KVPoll.FAILED
    sender.close()
    worker.check_whole()


def test_unmatched_want_times_out(decodes, pool_layout) -> None:
    worker = Worker(small_spec("bfloat16", pool_layout), want_timeout_s=SHORT_WANT_TIMEOUT_S)
    try:
        decode = decodes(worker)
        assert decode.call("registered", 10.0) is None
        assert decode.call("want", 104, list(range(8)), 0, 0) == "ok"
        # The reason names the want's timeout; the wait is long only for a slow machine.
        state, reason = decode.call("wait", 104, 30.0, timeout_s=40.0)
        assert (state, reason) == ("failed", "prefill request never arrived")
        worker.check_whole()
    finally:
        worker.backend.close()


def raw_register(worker: Worker, frame: bytes) -> wire.Message:
    """Register with a hand-made metadata frame over a bare DEALER; the worker's answer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker.backend.bootstrap_endpoint)
    regions = worker.regions  # any addresses: the frame is refused before they matter
    sock.send(wire.encode(wire.Register.of("raw", frame, regions, regions.layout.compat_hash())))
    assert worker.drive(lambda: bool(sock.poll(0)), 5.0)
    reply = wire.decode(sock.recv())
    sock.close()
    return reply


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda f: f[:-7], "length mismatch"),
        (lambda f: f[:20], "truncated"),
        (lambda f: f[:60] + bytes([f[60] ^ 0xFF]) + f[61:], "checksum"),
        (lambda f: b"XXXX" + f[4:], "magic"),
    ],
)
def test_corrupt_metadata_is_refused_and_worker_serves_on(workers, decodes, mangle, why) -> None:
    from prefill_worker.transfer.nixl.agent import make_agent

    worker = workers["bfloat16"]
    real = make_agent("raw", ["UCX"]).get_agent_metadata()
    reply = raw_register(worker, mangle(wire.frame_metadata(real)))
    assert isinstance(reply, wire.Registered) and not reply.is_ok
    assert why in (reply.reason or "")
    decode = decodes(worker)
    sender = ready_sender(worker, decode, room=105)
    pages = worker.alloc(8)
    sender.send_pages(pages, 0)
    row = worker.aux.try_alloc()
    assert row is not None
    sender.send_aux(row)
    assert worker.drive(lambda: sender.poll() is KVPoll.SUCCESS)
    assert decode.call("wait", 105, 5.0) == ("done", None)
    sender.close()
    worker.pages.free(pages)
    worker.aux.free(row)
    worker.check_whole()


def test_layout_mismatch_is_refused_with_reason(workers, decodes, pool_layout) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker, small_spec("bfloat16", pool_layout, head_dim=16))
    reason = decode.call("registered", 10.0)
    assert reason and "layout mismatch" in reason
    assert decode.call("want", 106, list(range(8)), 0, 0) == "ok"
    state, why = decode.call("wait", 106, 1.0)
    assert state == "failed" and "layout mismatch" in why
    worker.check_whole()


def test_the_other_pool_layout_is_refused_naming_both(workers, decodes, pool_layout) -> None:
    worker = workers["bfloat16"]
    other = "page_major" if pool_layout == "layer_major" else "layer_major"
    decode = decodes(worker, small_spec("bfloat16", other))
    reason = decode.call("registered", 10.0)
    assert reason == (
        f"KV layout mismatch: the decode pool is {other}, this worker's is {pool_layout}; "
        f"allocate the decode pool {pool_layout} (or run the worker with cache.layout: {other})"
    )
    assert worker.backend.reject_counts.get("layout_mismatch", 0) >= 1
    worker.check_whole()


def test_abort_from_decode(workers, decodes) -> None:
    worker = workers["bfloat16"]
    decode = decodes(worker)
    sender = ready_sender(worker, decode, room=107)
    pages = worker.alloc(8)
    sender.send_pages(pages[:4], 0)
    assert decode.call("abort", 107) == "ok"
    assert worker.drive(lambda: sender.poll() is KVPoll.ABORTED)
    sender.send_pages(pages[4:], 4)  # the scheduler may not have looked yet: ignored
    sender.close()
    worker.pages.free(pages)
    assert decode.call("wait", 107, 3.0) == ("aborted", "aborted by decode")
    worker.check_whole()


def test_prefill_killed_decode_sees_failed(tmp_path, pool_layout) -> None:
    from prefill_worker.transfer import KVReceiver, RoomState
    from tests.integration.transfer.conftest import CTX
    from tests.integration.transfer.peers import prefill_main, regions_over

    spec = small_spec("bfloat16", pool_layout)
    conn, child = CTX.Pipe()
    proc = CTX.Process(target=prefill_main, args=(child, spec, PEER_TIMEOUT_S), daemon=True)
    proc.start()
    try:
        assert conn.poll(30)
        endpoint = conn.recv()
        pool = np.zeros(spec.nbytes, np.uint8)
        receiver = KVReceiver(
            regions_over(spec, pool),
            endpoint,
            peer_timeout_s=PEER_TIMEOUT_S,
            heartbeat_interval_s=0.1,
        )
        receiver.wait_registered(10.0)
        receiver.want(108, list(range(8)), 0, 0)
        assert receiver.poll(108).state is RoomState.PENDING
        assert proc.pid is not None
        proc.kill()
        start = time.monotonic()
        while receiver.poll(108).state is RoomState.PENDING:
            assert time.monotonic() - start < PEER_TIMEOUT_S + SLACK_S
            time.sleep(0.005)
        status = receiver.poll(108)
        assert status.state is RoomState.FAILED and "silent" in (status.reason or "")
        assert time.monotonic() - start <= PEER_TIMEOUT_S + SLACK_S
        receiver.forget(108)
        receiver.close()
    finally:
        proc.kill()
        proc.join(5)


def test_receiver_from_tensors_in_process(workers, pool_layout) -> None:
    """The SDK over torch tensors, both agents in one process: pages and the aux row land."""
    import torch

    from prefill_worker.transfer import KVReceiver, RoomState

    worker = workers["bfloat16"]
    lay = worker.spec.layout
    page = (lay.page_size, lay.num_kv_heads, lay.head_dim)
    if pool_layout == "layer_major":
        pool = torch.zeros((lay.num_layers, 2, lay.num_pages, *page), dtype=torch.bfloat16)
        ks, vs = list(pool[:, 0]), list(pool[:, 1])
    else:
        pool = torch.zeros((lay.num_pages, lay.num_layers, 2, *page), dtype=torch.bfloat16)
        ks = [pool[:, layer, 0] for layer in range(lay.num_layers)]
        vs = [pool[:, layer, 1] for layer in range(lay.num_layers)]
    receiver = KVReceiver.from_tensors(
        ks,
        vs,
        worker.backend.bootstrap_endpoint,
        num_aux_rows=4,
        pool_layout=pool_layout,
        peer_timeout_s=PEER_TIMEOUT_S,
    )
    assert worker.drive(lambda: receiver.is_registered)
    receiver.want(109, [5, 2], 3, 0)
    sender = worker.backend.create_sender(109, "req-109", 8)
    assert worker.drive(lambda: sender.poll() is KVPoll.READY)
    pages = worker.alloc(2)
    sender.send_pages(pages, 0)
    row = worker.aux.try_alloc()
    assert row is not None
    worker.aux.write(row, AuxRow(77, -0.25, 8, 0))
    sender.send_aux(row)
    assert worker.drive(lambda: receiver.poll(109).state is not RoomState.PENDING)
    assert receiver.poll(109).state is RoomState.DONE
    assert receiver.read_aux(3) == AuxRow(77, -0.25, 8, 0)
    for layer in range(lay.num_layers):
        for kv, tensors in enumerate((ks, vs)):
            got = tensors[layer].contiguous().view(torch.uint8).numpy().reshape(lay.num_pages, -1)
            assert np.array_equal(got[5], layer_page(worker.pool, lay, layer, kv, pages[0]))
            assert np.array_equal(got[2], layer_page(worker.pool, lay, layer, kv, pages[1]))
            assert not got[[0, 1, 3, 4]].any()
    receiver.forget(109)
    sender.close()
    worker.pages.free(pages)
    worker.aux.free(row)
    receiver.close()
    assert worker.drive(lambda: worker.backend.num_peers == 0, 2.0)
    worker.check_whole()


def test_taken_bootstrap_address_is_an_os_error(workers) -> None:
    from prefill_worker.transfer import make_backend
    from prefill_worker.transfer.options import NativeOptions

    worker = workers["bfloat16"]
    with pytest.raises(OSError, match="cannot bind"):
        make_backend(worker.regions, NativeOptions(worker.backend.bootstrap_endpoint, 1.0, 0.1))
