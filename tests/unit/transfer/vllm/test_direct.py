"""A vllm_blocks pool served straight from its pages (``vllm.direct``): the answer names the
request's own pool pages, pinned as they are handed over, and every path (a READ's
notification, a lease, a request that ended first, a front that gave up, shutdown) unpins
them; the page table is whole after each."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import LAYER_MAJOR, VLLM_BLOCKS, KVLayout
from prefill_worker.kv.page_cache import PagePrefixCache
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.pins import PagePins
from prefill_worker.kv.tables import PageTable
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.vllm.desk import PullDesk, PullIdentity
from prefill_worker.transfer.vllm.direct import DirectSender, PoolBlocks, is_direct
from prefill_worker.transfer.vllm.holds import HoldTable
from prefill_worker.transfer.vllm.shared import GroupStaging
from prefill_worker.transfer.vllm.staging import PoolViews, StagingRefused
from prefill_worker.transfer.vllm.tickets import Tickets
from tests.clocks import FakeClock

PS, PAGES = 4, 12
LAYOUT = KVLayout(2, 2, 8, "float32", PS, PAGES, VLLM_BLOCKS)
CACHE = KVCache(LAYOUT, torch.device("cpu"))
REGIONS = CACHE.regions(0, 1)


class _Rig:
    def __init__(self, clock: FakeClock) -> None:
        self.pool = PagePool(PAGES)
        self.pins = PagePins(self.pool)
        self.table = PageTable(self.pool, PS, PagePrefixCache(self.pool, PS), pins=self.pins)
        self.blocks = PoolBlocks(REGIONS, PS, self.pins)
        holds, tickets = HoldTable(30.0, 5.0), Tickets(8)
        repacker = ThreadPoolExecutor(1)
        self.desk = PullDesk(self.blocks, PoolViews(REGIONS), holds, tickets, clock, repacker)
        self.desk.identities = {"0.34.0": PullIdentity("engine-1", "10.0.0.1", 5600, 7)}

    def sender(self, room: int, prompt: list[int]) -> tuple[DirectSender, tuple[int, ...]]:
        """A claimed request's sender, its pages reserved (as admission does)."""
        assert self.desk.tickets.open(room, "0.34.0")
        pages = self.table.try_reserve(f"r{room}", prompt)
        assert pages is not None
        sender = DirectSender(self.desk, self.blocks, room, len(prompt))
        assert sender.poll() is KVPoll.READY
        return sender, pages

    def finish(self, room: int, sender: DirectSender) -> None:
        """The request ends as the engine ends it: its sender closed, its pages released."""
        sender.close()
        self.table.release(f"r{room}")
        self.table.check_integrity()


def _served(rig: _Rig, room: int, prompt: list[int]) -> tuple[str, tuple[int, ...]]:
    sender, pages = rig.sender(room, prompt)
    sender.send_pages(pages[:2], 0)  # the first chunk's pages
    sender.send_pages(pages[1:], 1)  # the next chunk's, from the page the first ended in
    assert sender.poll() is KVPoll.TRANSFERRING
    sender.send_aux(0)
    assert sender.poll() is KVPoll.SUCCESS and sender.transfer_stats().bytes == 0
    rig.finish(room, sender)
    params = rig.desk.tickets.take(room)
    assert params is not None
    return params["remote_request_id"], pages


def test_a_page_handed_over_by_two_chunks_is_pinned_once_and_held_under_the_answer() -> None:
    rig = _Rig(FakeClock(100.0))
    hold_id, pages = _served(rig, 5, list(range(1, 14)))  # 13 tokens: 4 pages
    assert rig.pins.pinned() == dict.fromkeys(pages, 1)
    assert rig.desk.holds.take(hold_id) == pages  # what the pusher WRITEs: the pool's pages
    rig.blocks.free(pages)  # as the pusher does once its WRITE settled
    rig.table.check_integrity()
    assert rig.pool.num_free == PAGES


def test_a_read_notification_unpins_every_page_of_the_request() -> None:
    rig = _Rig(FakeClock(100.0))
    assert rig.desk.tickets.open(5, "0.34.0")
    pages = rig.table.try_reserve("r5", list(range(1, 14)))
    assert pages is not None
    sender = DirectSender(rig.desk, rig.blocks, 5, 13)
    assert sender.poll() is KVPoll.READY
    sender.send_pages(pages, 0)
    rig.table.commit("r5", 13)  # its 3 full pages enter the prefix cache
    sender.send_aux(0)
    params = rig.desk.tickets.take(5)
    assert params is not None and params["remote_block_ids"] == [list(pages)]
    assert params["remote_num_tokens"] == 13 and rig.desk.counts.pool_tokens == 13
    rig.finish(5, sender)
    assert rig.pins.num_pinned == 4 and rig.pool.num_free == PAGES - 4
    assert rig.blocks.num_free == PAGES - 4
    rig.desk.notify("d0", f"{params['remote_request_id']}:1".encode())
    rig.table.check_integrity()
    assert rig.pins.num_pinned == 0 and rig.pool.num_free == PAGES - 3  # 3 full pages cached
    assert rig.table.cache.num_evictable == 3


def test_a_lease_that_ends_unpins_after_the_read_grace() -> None:
    clock = FakeClock(100.0)
    rig = _Rig(clock)
    _served(rig, 5, list(range(1, 10)))
    clock.now = 131.0
    rig.desk.expire()
    assert rig.pins.num_pinned == 3  # a READ posted just before the lease may still run
    clock.now = 136.0
    rig.desk.expire()
    rig.table.check_integrity()
    assert rig.pins.num_pinned == 0 and rig.desk.holds.counts.expired == 1


def test_a_request_that_ends_before_its_answer_unpins_what_it_handed_over() -> None:
    rig = _Rig(FakeClock(100.0))
    sender, pages = rig.sender(1, list(range(1, 14)))
    sender.send_pages(pages[:2], 0)
    assert rig.pins.num_pinned == 2
    sender.fail("aborted by the router")
    sender.send_pages(pages[2:], 2)  # a forward collected after the failure pins nothing
    sender.send_aux(0)
    assert sender.poll() is KVPoll.FAILED and sender.failure_reason() == "aborted by the router"
    rig.finish(1, sender)
    assert rig.pins.num_pinned == 0 and rig.pool.num_free + rig.table.cache.num_pages == PAGES


def test_a_front_that_gave_up_or_pages_never_handed_over_unpin_at_once() -> None:
    rig = _Rig(FakeClock(100.0))
    sender, pages = rig.sender(1, list(range(1, 10)))
    sender.send_pages(pages, 0)
    rig.desk.tickets.take(1)  # the client went away
    sender.send_aux(0)
    assert sender.poll() is KVPoll.FAILED
    assert sender.failure_reason() == "the HTTP request gave up before its KV was staged"
    assert rig.desk.counts.pool_tokens == 0  # nothing served
    rig.finish(1, sender)
    assert rig.pins.num_pinned == 0
    sender, pages = rig.sender(2, list(range(1, 10)))
    sender.send_pages(pages[1:], 1)
    sender.send_aux(0)
    assert sender.failure_reason() == "prompt pages [0] were never handed over"
    rig.finish(2, sender)
    assert rig.pins.num_pinned == 0


def test_shutdown_unpins_every_hold_and_the_bytes_are_the_pools_own() -> None:
    """The blocks a decode reads are the pool's pages: the registered region of layer l is
    the layer's storage, page p's block at p * block_bytes, K‖V per head and token."""
    rig = _Rig(FakeClock(100.0))
    _served(rig, 5, list(range(1, 10)))
    _served(rig, 6, list(range(50, 55)))
    assert rig.pins.num_pinned == 5
    rig.desk.close()
    rig.table.check_integrity()
    assert rig.pins.num_pinned == 0
    lay = rig.blocks.layout
    assert rig.blocks.region_base_addrs == CACHE.k_base_addrs
    assert (lay.num_blocks, lay.block_size, lay.block_bytes) == (PAGES, PS, 2 * 4 * 2 * 8 * 4)
    assert lay.region_bytes == LAYOUT.region_bytes


def test_pools_not_in_vllm_blocks_or_of_another_block_size_are_refused() -> None:
    pins = PagePins(PagePool(PAGES))
    assert is_direct(REGIONS)
    with pytest.raises(StagingRefused, match="set them equal"):
        PoolBlocks(REGIONS, 2 * PS, pins)
    with pytest.raises(StagingRefused, match="pins over 3 pages"):
        PoolBlocks(REGIONS, PS, PagePins(PagePool(3)))
    other = KVCache(KVLayout(2, 2, 8, "float32", PS, PAGES, LAYER_MAJOR), torch.device("cpu"))
    assert not is_direct(other.regions(0, 1))
    with pytest.raises(StagingRefused, match="not in vLLM's blocks"):
        PoolBlocks(other.regions(0, 1), PS, pins)


def test_at_tp_2_the_blocks_are_the_group_s_shared_pool_every_head() -> None:
    """A tensor-parallel group's pool (``service.vllm_group``): the blocks cover every head,
    one region per layer in the shared buffer, a page of a layer one run of all of them."""
    group_layout = KVLayout(2, 4, 8, "float32", PS, PAGES, VLLM_BLOCKS)  # 2 heads a rank
    rank0 = KVCache(dataclasses.replace(group_layout, num_kv_heads=2), torch.device("cpu"))
    buffer = np.zeros(group_layout.pool_bytes, np.uint8)
    rank0.share_storage(buffer, 4, range(0, 2))
    group = GroupStaging(buffer, 4, range(0, 2))
    blocks = PoolBlocks(rank0.regions(0, 1), PS, PagePins(PagePool(PAGES)), group)
    lay = blocks.layout
    assert (lay.num_kv_heads, lay.block_bytes) == (4, 4 * PS * 2 * 8 * 4)
    assert blocks.region_base_addrs == (buffer.ctypes.data, buffer.ctypes.data + lay.region_bytes)
    assert rank0.k_base_addrs[1] == blocks.region_base_addrs[1]  # rank 0's heads come first
