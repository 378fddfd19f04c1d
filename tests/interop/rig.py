"""The prefill side of the landing tests (``test_landing``, ``test_mla_landing``): this
worker's ``SglangBackend`` in the test's process, over a pool of random bytes, with its
``AuxPool`` and ``PagePool``, driven by the test; and ``push``, the engine's part for one
request. Where a region's pages lie in the pool is the subclass's (``regions``, ``page``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.pages import PagePool
from prefill_worker.request import TransferStats
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.options import DEFAULT_HOOKS, Hooks, NixlOptions, SglangOptions
from prefill_worker.transfer.sglang.backend import SglangBackend
from prefill_worker.transfer.swa_window import SlidingLayers


class PrefillRig:
    """An ``SglangBackend`` over ``pool`` (random bytes from ``seed``) and an ``AuxPool``."""

    def __init__(
        self,
        layout: KVLayout,
        seed: int,
        agent_name: str,
        num_aux_rows: int = 8,
        write_timeout_s: float = 5.0,
        hooks: Hooks = DEFAULT_HOOKS,
        sliding: SlidingLayers | None = None,
        draft: DraftSide | None = None,
    ) -> None:
        """``sliding``: a sliding-window model's layers (``SglangOptions.sliding``)."""
        self.layout = layout
        rng = np.random.default_rng(seed)
        self.pool = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
        self.aux = AuxPool(num_aux_rows)
        self.pages = PagePool(layout.num_pages)
        options = SglangOptions(
            "127.0.0.1:0",
            "127.0.0.1",
            0,
            "fp8_e4m3" if layout.dtype == "fp8_e4m3" else "auto",  # what /route announces
            write_timeout_s,
            5.0,
            nixl=NixlOptions(agent_name),
            sliding=sliding,
        )
        self.backend = SglangBackend(self.regions(), options, hooks, draft)

    def regions(self) -> KVRegions:
        raise NotImplementedError

    def page(self, region: int, page: int) -> np.ndarray:
        raise NotImplementedError

    @property
    def bootstrap(self) -> str:
        return self.backend.bootstrap_endpoint

    def drive(self, until: Callable[[], bool], timeout_s: float = 30.0) -> bool:
        """The engine's loop (poll, wait on the backend) until ``until()``; False past the
        deadline."""
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                return False
            self.backend.poll()
            self.backend.wait(0.002)
        return True

    def check_whole(self) -> None:
        """Every page, aux row, sender and NIXL handle back."""
        backend = self.backend
        assert backend.num_open_senders == 0
        assert backend.num_inflight_transfers() == 0
        backend.check_integrity()
        assert self.aux.num_free == self.aux.num_rows
        assert self.pages.num_free == self.pages.num_pages


def push(
    rig: PrefillRig,
    room: int,
    num_tokens: int,
    chunk_pages: int,
    stats: list[TransferStats] | None = None,
    on_aux_row: Callable[[int], None] = lambda row: None,
) -> tuple[AuxRow, list[int]]:
    """The engine's part for one request: chunks of pages, then the aux row (``on_aux_row``
    called with it first: a draft's proposal goes there); until SUCCESS. Returns the aux
    row and the worker pages that held the prompt; ``stats`` gets what landed."""
    lay = rig.layout
    sender = rig.backend.create_sender(room, f"req-{room}", num_tokens)
    assert rig.drive(lambda: sender.poll() is not KVPoll.BOOTSTRAPPING)
    assert sender.poll() is KVPoll.READY, sender.failure_reason()
    src = rig.pages.try_alloc(-(-num_tokens // lay.page_size))
    assert src is not None
    for first in range(0, len(src), chunk_pages):
        sender.send_pages(src[first : first + chunk_pages], first)
    row = rig.aux.try_alloc()
    assert row is not None
    computed = num_tokens - 3 * (room % 2)  # some rooms: 3 tokens from the prefix cache
    aux = AuxRow(200 + room % 100, -0.25, num_tokens, sender.num_cached_tokens(), 1, computed)
    rig.aux.write(row, aux)
    on_aux_row(row)
    sender.send_aux(row)
    assert rig.drive(lambda: sender.poll().is_terminal)
    assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()
    if stats is not None:
        stats.append(sender.transfer_stats())
    sender.close()
    rig.drive(lambda: rig.backend.num_open_senders == 0)
    rig.aux.free(row)
    rig.pages.free(src)
    return aux, src
