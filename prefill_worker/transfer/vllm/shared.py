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
(``writer_heads``). The region is a file in ``/dev/shm`` the leader creates, sizes and maps;
the followers map it by its path (sent over the group, ``tp/staging.py``), and the leader
unlinks it once they have: nothing is left behind when the group ends, however it ends. Only
a group on one host can share it (the configuration refuses ``parallel.interface``).
Torch-free.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from prefill_worker.kv.heads import kv_head_range

SHM_DIR = "/dev/shm"  # memory-backed; a plain temporary directory where a host has none


@dataclass(frozen=True, slots=True, eq=False)
class GroupStaging:
    """What one rank stages into: the shared region's memory, the model's KV heads (the
    region holds them all), and the heads this rank's forward writes (None: none)."""

    buffer: np.ndarray  # uint8, the region's size
    num_kv_heads: int
    heads: range | None


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
