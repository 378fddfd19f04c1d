"""Fixtures for real-NIXL transfer tests: the prefill side in this process, decode peers (or a
prefill worker) in spawned child processes, pools we can read byte for byte."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import pytest

from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.layout import LAYER_MAJOR, PAGE_MAJOR, KVLayout
from prefill_worker.kv.pages import PagePool
from prefill_worker.transfer.base import KVPoll
from tests.integration.transfer.peers import PoolSpec, decode_main, regions_over

CTX = mp.get_context("spawn")
# The worker drops a decode silent this long (its heartbeats come from a process of their own).
PEER_TIMEOUT_S = 1.5
# This process turns the worker only while a test waits on it (``Worker.drive``): a step that
# does not (starting an agent or a decode process) must not look like a silent worker to the
# decode, nor outlast a want that waits for its request. Both are long unless a test proves
# them (``test_unmatched_want_times_out``, ``test_a_pending_room_times_out_in_the_sdk``).
WORKER_SILENT_S = 60.0  # the decodes' peer timeout of the worker
WANT_TIMEOUT_S = 60.0


def small_spec(dtype: str, pool_layout: str, head_dim: int = 8, num_pages: int = 24) -> PoolSpec:
    return PoolSpec(KVLayout(2, 2, head_dim, dtype, 4, num_pages, pool_layout), num_aux_rows=8)


@pytest.fixture(scope="module", params=(LAYER_MAJOR, PAGE_MAJOR), autouse=True)
def pool_layout(request: pytest.FixtureRequest) -> str:
    """Every transfer test runs once per K/V-plane pool layout (``kv.layout``); a
    ``vllm_blocks`` pool has its own test (``test_vllm_blocks_native``)."""
    return str(request.param)


class Worker:
    """The prefill side: a NixlBackend over a random pool and an AuxPool, in this process."""

    def __init__(
        self, spec: PoolSpec, want_timeout_s: float = WANT_TIMEOUT_S, **options: Any
    ) -> None:
        """``options``: make_backend's keywords (limits, curve, ucx_net_devices), and the
        backend's hooks ``on_reject`` and ``clock``."""
        from prefill_worker.transfer import make_backend
        from prefill_worker.transfer.options import Hooks, NativeOptions, NixlOptions

        self.spec = spec
        self.pool = np.random.default_rng(1).integers(0, 256, spec.nbytes, dtype=np.uint8)
        self.pristine = self.pool.copy()
        self.aux = AuxPool(spec.num_aux_rows)
        self.pages = PagePool(spec.layout.num_pages)
        self.regions = regions_over(spec, self.pool, self.aux.base_addr)
        clock = options.pop("clock", time.monotonic)
        state = options.pop("state", None)  # a StateRegions: a hybrid model's state pool
        draft = options.pop("draft", None)  # a DraftSide: a draft model's pool and rows
        hooks = Hooks(clock=clock, on_reject=options.pop("on_reject", None))
        nixl = NixlOptions(ucx_net_devices=options.pop("ucx_net_devices", None))
        bind = "tcp://127.0.0.1:0"
        native = NativeOptions(bind, PEER_TIMEOUT_S, 0.1, want_timeout_s, nixl, **options)
        self.backend = make_backend(self.regions, native, hooks, state, draft)

    def alloc(self, num_pages: int) -> list[int]:
        pages = self.pages.try_alloc(num_pages)
        assert pages is not None
        return pages

    def finish(self, sender: Any, aux: AuxRow) -> int:
        """Write ``aux`` into a fresh aux row, send it as the room's last op and drive the
        sender to SUCCESS; the row (free it after the sender's ``close``)."""
        row = self.aux.try_alloc()
        assert row is not None
        self.aux.write(row, aux)
        sender.send_aux(row)
        assert self.drive(lambda: sender.poll().is_terminal)
        assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()
        return row

    def drive(self, until: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Poll the backend until ``until()`` holds or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                return False
            self.backend.poll()
            time.sleep(0.0005)
        return True

    def check_whole(self) -> None:
        """No sender open, no write in flight, every page and aux row back, the pool untouched.
        (Releases run on the transfer thread: a write just released may take a poll to settle.)"""
        backend = self.backend
        assert self.drive(lambda: backend.num_inflight_transfers() == 0)
        assert backend.num_open_senders == 0
        assert backend.num_inflight_transfers() == 0
        backend.check_integrity()
        self.aux.check_integrity()
        assert self.aux.num_free == self.aux.num_rows
        self.pages.check_integrity()
        assert self.pages.num_free == self.pages.num_pages
        assert np.array_equal(self.pool, self.pristine)


class Decode:
    """A KVReceiver in a child process over a shared-memory pool this process can read."""

    def __init__(
        self,
        worker: Worker,
        spec: PoolSpec,
        timeout_s: float = WORKER_SILENT_S,
        options: dict[str, Any] | None = None,
    ):
        self.worker = worker
        self.spec = spec
        self.shm = shared_memory.SharedMemory(create=True, size=spec.nbytes)
        self.pool = np.frombuffer(self.shm.buf, dtype=np.uint8)
        self.pool[:] = np.random.default_rng(2).integers(0, 256, spec.nbytes, dtype=np.uint8)
        self.regions = regions_over(spec, self.pool)
        self.conn, child = CTX.Pipe()
        endpoint = worker.backend.bootstrap_endpoint
        args = (child, self.shm.name, spec, endpoint, timeout_s, options)
        self.proc = CTX.Process(target=decode_main, args=args, daemon=True)
        self.proc.start()
        assert self.conn.poll(30), "decode peer did not start"
        assert self.conn.recv() == "started"

    def call(self, *cmd: object, timeout_s: float = 10.0) -> object:
        """Send a command; drive the worker until the child answers."""
        self.conn.send(cmd)
        assert self.worker.drive(lambda: self.conn.poll(0), timeout_s), f"no answer to {cmd}"
        return self.conn.recv()

    def signal(self, sig: int) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.is_alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
        self.proc.join(10)
        self.shm.unlink()
        del self.pool
        # A failed assertion's traceback may still hold views of the pool; then the mapping
        # is freed with them, later.
        with contextlib.suppress(BufferError):
            self.shm.close()


@pytest.fixture(scope="module")
def workers(pool_layout: str) -> Iterator[dict[str, Worker]]:
    made: dict[str, Worker] = {}

    class Lazy(dict[str, Worker]):
        def __missing__(self, dtype: str) -> Worker:
            made[dtype] = self[dtype] = Worker(small_spec(dtype, pool_layout))
            return made[dtype]

    yield Lazy()
    for worker in made.values():
        worker.backend.close()


@pytest.fixture
def decodes() -> Iterator[Callable[..., Decode]]:
    started: list[Decode] = []

    def start(worker: Worker, spec: PoolSpec | None = None, **kwargs: Any) -> Decode:
        started.append(Decode(worker, spec or worker.spec, **kwargs))
        return started[-1]

    yield start
    for decode in started:
        decode.close()
