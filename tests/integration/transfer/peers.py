"""Child-process mains for the transfer tests: a decode peer (KVReceiver over a shared-memory
pool the test reads directly) and a prefill worker (NixlBackend). Commands come over a pipe."""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import LAYER_MAJOR, MLA, VLLM_BLOCKS, KVLayout, KVRegions


@dataclass(frozen=True, slots=True)
class PoolSpec:
    layout: KVLayout
    num_aux_rows: int

    @property
    def nbytes(self) -> int:
        return self.layout.pool_bytes + self.num_aux_rows * AUX_ROW_BYTES


def regions_over(spec: PoolSpec, buf: np.ndarray, aux_addr: int | None = None) -> KVRegions:
    """The pool at the start of ``buf`` in its layout (``kv.layout``): layer-major, K of each
    layer then V of each layer; page-major, page after page of every layer's K and V; mla,
    each layer's latent (no V). Then the aux rows (unless they live at ``aux_addr``)."""
    lay = spec.layout
    base = int(buf.ctypes.data)
    aux = base + lay.pool_bytes if aux_addr is None else aux_addr
    k = tuple(base + layer_page_offset(lay, layer, 0, 0) for layer in range(lay.num_layers))
    v = tuple(base + layer_page_offset(lay, layer, 1, 0) for layer in range(lay.num_layers))
    v = () if lay.kind == MLA else v
    return KVRegions(lay, k, v, "cpu", aux, spec.num_aux_rows)


def layer_page_offset(lay: KVLayout, layer: int, kv: int, page: int) -> int:
    """Byte offset in a pool of page ``page`` of layer ``layer``'s K (``kv`` 0) or V (1), or
    its latent (``kv`` 0, an mla pool)."""
    if lay.kind in (LAYER_MAJOR, MLA):
        return (kv * lay.num_layers + layer) * lay.region_bytes + page * lay.page_bytes
    if lay.kind == VLLM_BLOCKS:  # K‖V interleaved: a plane's first row (not a run)
        return (
            layer * lay.region_bytes
            + page * lay.region_page_bytes
            + kv * lay.head_dim * lay.itemsize
        )
    return page * lay.region_page_bytes + (2 * layer + kv) * lay.page_bytes


def layer_page(buf: np.ndarray, lay: KVLayout, layer: int, kv: int, page: int) -> np.ndarray:
    """The bytes of one layer's K or V page in a pool at the start of ``buf``."""
    start = layer_page_offset(lay, layer, kv, page)
    return buf[start : start + lay.page_bytes]


def decode_main(
    conn: Connection,
    shm_name: str,
    spec: PoolSpec,
    addr: str,
    timeout_s: float,
    options: dict[str, Any] | None = None,
) -> None:
    from prefill_worker.transfer import KVReceiver, RoomState

    shm = shared_memory.SharedMemory(name=shm_name)
    buf = np.frombuffer(shm.buf, dtype=np.uint8)
    receiver = KVReceiver(
        regions_over(spec, buf),
        addr,
        peer_timeout_s=timeout_s,
        heartbeat_interval_s=0.1,
        **(options or {}),
    )
    conn.send("started")
    while True:
        receiver.progress()
        if not conn.poll(0.002):
            continue
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "name":
            conn.send(receiver.agent_name)
        if cmd == "registered":
            try:
                receiver.wait_registered(args[0])
                conn.send(None)
            except RuntimeError as exc:
                conn.send(str(exc))
        elif cmd == "want":
            receiver.want(*args)
            conn.send("ok")
        elif cmd == "abort":
            receiver.abort(args[0])
            conn.send("ok")
        elif cmd == "wait":
            room, deadline = args[0], time.monotonic() + args[1]
            status = receiver.poll(room)
            while status.state is RoomState.PENDING and time.monotonic() < deadline:
                time.sleep(0.001)
                status = receiver.poll(room)
            conn.send((status.state.value, status.reason))
    receiver.close()
    del buf
    shm.close()


def prefill_main(
    conn: Connection, spec: PoolSpec, timeout_s: float, ucx_net_devices: str | None = None
) -> None:
    from prefill_worker.transfer import make_backend
    from prefill_worker.transfer.options import NativeOptions, NixlOptions

    buf = np.zeros(spec.nbytes, np.uint8)
    nixl = NixlOptions(ucx_net_devices=ucx_net_devices)
    options = NativeOptions("tcp://127.0.0.1:0", timeout_s, 0.1, 5.0, nixl)
    backend = make_backend(regions_over(spec, buf), options)
    conn.send(backend.bootstrap_endpoint)
    while True:
        backend.poll()
        time.sleep(0.001)
