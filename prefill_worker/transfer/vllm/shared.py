"""The staging region of a tensor-parallel worker: one region in shared memory that every rank
of the group maps, each rank's forward writing its own KV heads into it (docs/vllm.md,
"Workers with TP > 1").

vLLM's decodes see one prefill rank that holds every KV head (``tp_size`` 1 in the answer),
whatever the worker's own TP: each decode rank reads the heads it holds out of each block
(vLLM's connector does that for any decode TP over a prefill of TP 1). So the region is laid
out as at TP 1, and rank r's KV mirror is a view of its own heads of it::

    region, per layer [num_blocks, KV, block_size, 2 * D]      the leader's NIXL agent
    rank r writes       [:, heads(r), :, :]                       (kv.heads.kv_head_range)

A head replicated over several ranks (KV < TP) is written by the first of them only
(``writer_heads``). Tokens no forward of the request wrote (a prefix-cache hit) are
repacked by every rank from its own pool: the leader's on its repack thread, each
follower's as a ``Stage`` carried by the group's next step, and the request's answer waits
for both. The region is a file in ``/dev/shm`` the leader creates, sizes and maps; the
followers map it by its path (sent over the group, ``service/vllm_group.py``), and the
leader unlinks it once they have: nothing is left behind when the group ends, however it
ends. Only a group on one host can share it (the configuration refuses
``parallel.interface``).
Torch-free.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import numpy as np

from prefill_worker.kv.heads import kv_head_range

SHM_DIR = "/dev/shm"  # memory-backed; a plain temporary directory where a host has none


class Stage(msgspec.Struct, array_like=True, frozen=True):
    """A repack every follower runs for its own heads, as the leader does for its own
    (``staging.repack``): prompt positions [start, stop) of the prompt pages from
    ``first_page`` held in ``page_ids``, into the request's staging ``block_ids``. It rides on
    the group's next step, applied before that step's forward (``tp/step.py``)."""

    page_ids: list[int]
    first_page: int
    block_ids: list[int]
    start: int
    stop: int


class StageQueue:
    """The leader's stages for the followers: ``put`` queues one and returns a future that
    ends once the step that carried it was answered by every rank (each follower repacks a
    step's stages before it answers). The channel ``take``s the queue at each step and
    calls ``done`` (or ``fail``) after it. A future cancelled before its step took it is
    dropped: no follower copies it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[tuple[Stage, Future[int]]] = []

    def put(self, stage: Stage) -> Future[int]:
        future: Future[int] = Future()
        with self._lock:
            self._queued.append((stage, future))
        return future

    @property
    def has_queued(self) -> bool:
        with self._lock:
            return bool(self._queued)

    def take(self) -> tuple[list[Stage], list[Future[int]]]:
        """The stages for the step starting now (their futures running: no longer
        cancellable), and their futures."""
        with self._lock:
            queued, self._queued = self._queued, []
        taken = [(s, f) for s, f in queued if f.set_running_or_notify_cancel()]
        return [s for s, _ in taken], [f for _, f in taken]

    @staticmethod
    def done(futures: list[Future[int]]) -> None:
        for future in futures:
            future.set_result(0)  # the followers' bytes are counted as the leader's

    @staticmethod
    def fail(futures: list[Future[int]], error: BaseException) -> None:
        for future in futures:
            future.set_exception(error)


@dataclass(frozen=True, slots=True, eq=False)
class GroupStaging:
    """What one rank stages into: the shared region's memory, the model's KV heads (the
    region holds them all), and the heads this rank's forward writes (None: none). On the
    leader also the followers' repacks (``stages``) and how to send them now (``sync``: a
    step when none is running)."""

    buffer: np.ndarray  # uint8, the region's size
    num_kv_heads: int
    heads: range | None
    stages: StageQueue | None = None
    sync: Callable[[], None] = lambda: None


def writer_heads(num_kv_heads: int, rank: int, tp_size: int) -> range | None:
    """The KV heads rank ``rank`` writes into the shared region: its own, unless the rank
    before it holds the same ones (a replicated head: its first holder writes it)."""
    heads = kv_head_range(num_kv_heads, rank, tp_size)
    if rank > 0 and kv_head_range(num_kv_heads, rank - 1, tp_size) == heads:
        return None
    return heads


class SharedRegion:
    """``num_bytes`` of shared memory, zeroed, as one uint8 array (``buffer``); ``path`` names
    it for the other ranks until ``unlink``. The mapping lives as long as the process."""

    def __init__(self, num_bytes: int, path: str | None = None) -> None:
        """``path`` None: create a new file (the leader); otherwise map that one."""
        if path is None:
            where = SHM_DIR if os.path.isdir(SHM_DIR) else None
            fd, path = tempfile.mkstemp(prefix="prefill-worker-vllm-staging-", dir=where)
            try:
                os.ftruncate(fd, num_bytes)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != num_bytes:
                raise ValueError(f"shared staging {path}: {size} bytes, {num_bytes} expected")
            self._map = mmap.mmap(fd, num_bytes)
        finally:
            os.close(fd)
        self.path: str | None = path
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)

    def unlink(self) -> None:
        """The file goes (every rank has mapped it); the memory stays while mapped."""
        if self.path is not None:
            os.unlink(self.path)
            self.path = None
