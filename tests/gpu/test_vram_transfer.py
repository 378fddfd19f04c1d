"""A KV push between two processes over real NIXL, from a pool on one device into a decode
pool on the same kind of device, byte for byte, first token included.

On ``cuda`` (a ``gpu`` test) both pools are VRAM and the aux rows host DRAM: the mixed
registration a GPU worker and a GPU decode use. On ``cpu`` the same test runs here and in CI,
so the GPU variant is known to be a working test before a GPU ever runs it."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import pytest
import torch

from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer.base import KVPoll

LAYOUT = KVLayout(2, 2, 64, "bfloat16", 16, 32)
PAGE = (LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
SRC_PAGES, DST_PAGES, NUM_TOKENS, ROOM, AUX_SLOT = [5, 9, 20], [30, 2, 17], 40, 77, 1
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [
    pytest.param("cpu", id="dram"),
    pytest.param("cuda", id="vram", marks=[pytest.mark.gpu, CUDA]),
]
POOL_LAYOUTS = pytest.mark.parametrize("pool_layout", ["layer_major", "page_major"])


def pool_views(
    pool_layout: str, device: str, gen: torch.Generator | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V views ``[P, page_size, KV, D]`` of one pool tensor in the layout:
    ``[L, 2, P, ...]`` (layer-major) or ``[P, L, 2, ...]`` (page-major, strided views)."""
    num_layers, num_pages = LAYOUT.num_layers, LAYOUT.num_pages
    major = (
        (num_layers, 2, num_pages) if pool_layout == "layer_major" else (num_pages, num_layers, 2)
    )
    pool = torch.zeros((*major, *PAGE), dtype=torch.bfloat16)
    if gen is not None:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    pool = pool.to(device)
    if pool_layout == "layer_major":
        return list(pool[:, 0]), list(pool[:, 1])
    return [pool[:, i, 0] for i in range(num_layers)], [pool[:, i, 1] for i in range(num_layers)]


def decode_process(conn: Connection, device: str, bootstrap: str, pool_layout: str) -> None:
    """The decode: KVReceiver.from_tensors over a zeroed pool on ``device``; sends back the
    room's state, its aux row (pinned host memory on CUDA) and the bytes that landed."""
    from prefill_worker.transfer import KVReceiver, RoomState

    k, v = pool_views(pool_layout, device)
    receiver = KVReceiver.from_tensors(k, v, bootstrap, num_aux_rows=4, pool_layout=pool_layout)
    receiver.wait_registered(30)
    receiver.want(ROOM, DST_PAGES, AUX_SLOT, 0)
    conn.send("wanted")
    deadline = time.monotonic() + 30
    while receiver.poll(ROOM).state is RoomState.PENDING and time.monotonic() < deadline:
        receiver.progress()
    status, aux = receiver.poll(ROOM), receiver.read_aux(AUX_SLOT)
    landed = [t[DST_PAGES].cpu() for t in (*k, *v)]
    conn.send((status.state.value, status.reason, aux.first_token_id, landed))
    conn.recv()  # the parent has read it: only now may the pools go
    receiver.close()


@POOL_LAYOUTS
@pytest.mark.parametrize("device", DEVICES)
def test_kv_and_aux_land_byte_for_byte_between_processes(device: str, pool_layout: str) -> None:
    from prefill_worker.transfer import make_backend
    from prefill_worker.transfer.options import NativeOptions

    dev = torch.device(device)
    k, v = pool_views(pool_layout, device, torch.Generator().manual_seed(3))
    aux = AuxPool(4)
    name = "cpu" if dev.type == "cpu" else f"cuda:{torch.cuda.current_device()}"
    regions = KVRegions(
        dataclasses.replace(LAYOUT, kind=pool_layout),
        tuple(t.data_ptr() for t in k),
        tuple(t.data_ptr() for t in v),
        name,
        aux.base_addr,
        4,
    )
    backend = make_backend(regions, NativeOptions("tcp://127.0.0.1:0", 10.0, 0.1, 10.0))
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=decode_process,
        args=(child, device, backend.bootstrap_endpoint, pool_layout),
        daemon=True,
    )
    proc.start()
    try:
        assert drive(backend, lambda: parent.poll(0)), "the decode never registered"
        assert parent.recv() == "wanted"
        sender = backend.create_sender(ROOM, "req", NUM_TOKENS)
        assert drive(backend, lambda: sender.poll() is KVPoll.READY), sender.failure_reason()
        sender.send_pages(SRC_PAGES, 0)
        row = aux.try_alloc()
        assert row is not None
        aux.write(row, AuxRow(123, -0.5, NUM_TOKENS, 0))
        sender.send_aux(row)
        assert drive(backend, lambda: sender.poll().is_terminal)
        assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()
        assert drive(backend, lambda: parent.poll(0))
        state, reason, first_token, landed = parent.recv()
        parent.send("done")
        assert (state, reason, first_token) == ("done", None, 123)
        for got, src in zip(landed, (*k, *v), strict=True):
            assert torch.equal(got, src[SRC_PAGES].cpu())
        sender.close()
        aux.free(row)
    finally:
        proc.join(30)
        backend.close()


def drive(backend, until, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            return False
        backend.poll()
    return True
