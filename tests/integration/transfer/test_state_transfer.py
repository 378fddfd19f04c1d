"""A hybrid model's state over real NIXL, byte for byte: a worker (a NixlBackend over a random
KV pool and a random state pool, in this process) and a decode SDK with a state pool (a
KVReceiver with its I/O thread, in this process too). Two rooms, each pushed in two chunks:
the decode's pages hold the worker's pages and its state slot the worker's slot (the
request's aux row), every other byte of the decode untouched; the aux rows (state slots) and
pages are back afterwards. A room whose decode names no state slot fails
``state_unsupported`` with nothing written."""

from __future__ import annotations

import numpy as np
import pytest

from prefill_worker.kv.aux import AuxRow
from prefill_worker.kv.state_layout import LINEAR_STATE, StateComponent, StateRegions, StateTensor
from prefill_worker.transfer import KVReceiver, RoomState
from prefill_worker.transfer.base import KVPoll
from tests.integration.transfer.conftest import Worker, small_spec
from tests.integration.transfer.peers import layer_page_offset, regions_over

CONV = StateTensor("conv", (6, 3), "float32", 72)
RECURRENT = StateTensor("recurrent", (2, 3, 4), "float32", 96)
LAYERS = (0, 2, 3)


def state_pool(num_slots: int, fill: np.ndarray | None) -> tuple[np.ndarray, StateRegions]:
    """One buffer: per tensor, per layer, ``num_slots`` items; random or zeros."""
    component = StateComponent(LINEAR_STATE, LAYERS, (CONV, RECURRENT), num_slots)
    sizes = [t.item_bytes * num_slots for t in (CONV, RECURRENT) for _ in LAYERS]
    buf = np.zeros(sum(sizes), np.uint8) if fill is None else fill
    base, offsets = int(buf.ctypes.data), np.cumsum([0, *sizes[:-1]])
    addrs = tuple(int(base + o) for o in offsets)
    return buf, StateRegions(component, (addrs[:3], addrs[3:]), "cpu")


def slot_bytes(buf: np.ndarray, regions: StateRegions, slot: int) -> bytes:
    base = int(buf.ctypes.data)
    return b"".join(
        buf[a - base + slot * n : a - base + (slot + 1) * n].tobytes() for a, n in regions.runs
    )


@pytest.fixture
def rig(pool_layout: str):  # type: ignore[no-untyped-def]
    spec = small_spec("float32", pool_layout)
    rng = np.random.default_rng(11)
    worker_state, worker_regions = state_pool(spec.num_aux_rows, None)
    worker_state[:] = rng.integers(0, 256, worker_state.size, dtype=np.uint8)
    worker = Worker(spec, state=worker_regions)
    decode_kv = np.zeros(spec.nbytes, np.uint8)
    decode_state, decode_regions = state_pool(9, None)
    receiver = KVReceiver(
        regions_over(spec, decode_kv),
        worker.backend.bootstrap_endpoint,
        io_thread=True,
        state=decode_regions,
    )
    assert worker.drive(lambda: receiver.is_registered, 10.0)  # this process turns the worker
    yield (
        worker,
        receiver,
        decode_kv,
        (worker_state, worker_regions),
        (decode_state, decode_regions),
    )
    receiver.close()
    worker.backend.close()


def test_kv_and_state_land_byte_for_byte(rig) -> None:  # type: ignore[no-untyped-def]
    worker, receiver, decode_kv, (w_state, w_regions), (d_state, d_regions) = rig
    lay = worker.spec.layout

    def page(pool: np.ndarray, layer: int, kv: int, page_id: int) -> bytes:
        at = layer_page_offset(lay, layer, kv, page_id)
        return pool[at : at + lay.page_bytes].tobytes()

    landed = {}
    for room, state_slot, aux_slot in ((31, 7, 1), (32, 0, 2)):
        src = worker.alloc(3)
        dst = [20 - 2 * i for i in range(3)]
        receiver.want(room, dst, aux_slot, 0, state_slot=state_slot)
        sender = worker.backend.create_sender(room, f"r{room}", 3 * lay.page_size)
        assert worker.drive(lambda s=sender: s.poll() is KVPoll.READY)
        sender.send_pages(src[:2], 0)  # two chunks
        sender.send_pages(src[2:], 2)
        row = worker.finish(sender, AuxRow(room, -0.5, 3 * lay.page_size, 0))
        assert worker.drive(lambda r=room: receiver.poll(r).state is not RoomState.PENDING)
        assert receiver.poll(room).state is RoomState.DONE
        for layer in range(lay.num_layers):
            for kv in (0, 1):
                for s_page, d_page in zip(src, dst, strict=True):
                    assert page(decode_kv, layer, kv, d_page) == page(
                        worker.pool, layer, kv, s_page
                    )
        assert slot_bytes(d_state, d_regions, state_slot) == slot_bytes(w_state, w_regions, row)
        landed[state_slot] = row
        sender.close()
        worker.aux.free(row)
        worker.pages.free(src)
        receiver.forget(room)
    for slot in set(range(9)) - set(landed):
        assert not any(slot_bytes(d_state, d_regions, slot))  # no other slot written
    assert worker.drive(lambda: worker.backend.num_inflight_transfers() == 0)
    assert worker.aux.num_free == worker.aux.num_rows
    assert worker.pages.num_free == worker.pages.num_pages


def test_a_want_without_a_state_slot_fails_with_nothing_written(rig) -> None:  # type: ignore[no-untyped-def]
    worker, receiver, decode_kv, _, (d_state, _) = rig
    receiver.state = None  # the SDK then sends the want without dst_state_slot
    receiver.want(33, [1, 2], 0, 0)
    sender = worker.backend.create_sender(33, "r33", 5)
    assert worker.drive(lambda: sender.poll().is_terminal)
    assert sender.poll() is KVPoll.FAILED
    assert str(sender.failure_reason()).startswith("state_unsupported: the want names no")
    assert worker.drive(lambda: receiver.poll(33).state is RoomState.FAILED)
    sender.close()
    assert not decode_kv.any() and not d_state.any()
