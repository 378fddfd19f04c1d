"""A windowed sliding pool staged for vLLM 0.34's KV-cache groups (``window_staging``): from a
real ``KVCache`` whose sliding layers have their own page space, every full layer's position
and each sliding layer's window land in the staging blocks byte for byte, the window blocks'
positions no sliding page holds are zeros, the blocks a sliding group never sends are left
alone; a missing window page fails the room before anything is queued; the sender mirrors
nothing and every block returns."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import KVLayout
from prefill_worker.model.kv_cache import KVCache, SlidingSpace
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.vllm.desk import PullDesk, PullIdentity
from prefill_worker.transfer.vllm.groups import sliding_groups
from prefill_worker.transfer.vllm.holds import HoldTable
from prefill_worker.transfer.vllm.sender import VllmSender
from prefill_worker.transfer.vllm.staging import PoolViews, StagingPool, staging_layout
from prefill_worker.transfer.vllm.tickets import Tickets
from prefill_worker.transfer.vllm.window_staging import (
    StagedWindow,
    check_window,
    repack_window,
    staged_window,
)
from tests.clocks import FakeClock
from tests.polling import wait_until

H, D, PS, BS, WINDOW = 2, 4, 4, 8, 12  # the decode keeps WINDOW - 1 positions
PAGES, SLIDING_PAGES, BLOCKS = 90, 20, 48
GARBAGE = 0xFFFFFFFF  # what a staging block held before (a NaN as float32)
REPACKER = ThreadPoolExecutor(1, thread_name_prefix="test-window-repack")


class Windowed:
    """A windowed pool of ``num_layers`` (``sliding`` its sliding layers), random values in
    both page spaces, and a staging region of garbage over it."""

    def __init__(self, num_layers: int, sliding: tuple[int, ...]) -> None:
        lay = KVLayout(num_layers, H, D, "float32", PS, PAGES)
        self.cache = KVCache(lay, torch.device("cpu"), SlidingSpace(sliding, SLIDING_PAGES))
        for plane in (*self.cache.k, *self.cache.v):
            plane.copy_(torch.randn(plane.shape))
        regions = self.cache.regions(0, 0)
        self.pool = PoolViews(regions, sliding)
        self.staging = StagingPool(staging_layout(regions, BS, BLOCKS))
        for layer in range(num_layers):
            self.staging.layer_view(layer)[...] = GARBAGE
        layers = SlidingLayers(sliding, num_layers, WINDOW - 1, SLIDING_PAGES)
        self.groups = sliding_groups(layers, "GptOssForCausalLM", BS)
        self.window = staged_window(layers, self.groups, PS, BS)

    def token(self, layer: int, pages: list[int], t: int) -> np.ndarray:
        """Layer ``layer``'s K‖V of position ``t`` held in ``pages`` as staged: [H, 2D] bits."""
        k = self.cache.k[layer][pages[t // PS], t % PS]
        v = self.cache.v[layer][pages[t // PS], t % PS]
        return torch.cat([k, v], dim=-1).numpy().view(np.uint32)

    def staged(self, layer: int, blocks: tuple[int, ...], t: int) -> np.ndarray:
        return self.staging.layer_view(layer)[blocks[t // BS], :, t % BS]


def _request(n: int, window: StagedWindow, seed: int) -> tuple[list[int], list[int]]:
    """A prompt's pages (anywhere in the pool) and its sliding entries as the page table holds
    them once the last chunk ran: -1 below the held window."""
    rng = np.random.default_rng(seed)
    num_pages = -(-n // PS)
    pages = rng.permutation(PAGES)[:num_pages].tolist()
    held = window.held_start(n) // PS
    sliding = rng.permutation(SLIDING_PAGES)[: num_pages - held].tolist()
    return pages, [-1] * held + sliding


def test_the_window_arithmetic_follows_vllms_clipped_blocks() -> None:
    window = Windowed(3, (0, 2)).window
    assert window.window_blocks == -(-WINDOW // BS) + 1 == 3  # vLLM's cdiv(window, bs) + 1
    # 40 tokens: blocks 0..4, the sliding group's the last 3 (from 16); held from page 7
    assert (window.clip_start(40), window.held_start(40)) == (16, 28)
    assert window.kept(40) == range(28, 40) and window.cleared(40) == range(16, 28)
    assert window.kept(5) == range(0, 5) and not window.cleared(5)  # all of it held
    assert window.kept(17) == range(4, 17) and window.cleared(17) == range(0, 4)


@pytest.mark.parametrize(
    ("num_layers", "sliding"),
    [(3, (0, 2)), (4, (0, 2))],  # gpt-oss's tiny shape (a lone full layer: per layer); runs
)
@pytest.mark.parametrize("n", [1, 11, 31, 33, 70])
def test_full_layers_whole_and_sliding_layers_their_window(
    num_layers: int, sliding: tuple[int, ...], n: int
) -> None:
    pool = Windowed(num_layers, sliding)
    window = pool.window
    pages, entries = _request(n, window, seed=n)
    blocks = tuple(range(3, 3 + -(-n // BS)))
    copied = 0
    for first in range(0, len(pages), 3):  # chunks of three pages, as send_pages hands them
        tokens = range(first * PS, min((first + 3) * PS, n))
        chunk, chunk_entries = pages[first : first + 3], entries[first : first + 3]
        check_window(window, chunk_entries, len(chunk), first, tokens, n)
        args = (pool.pool, pool.staging, window, chunk, chunk_entries, first, blocks, tokens)
        copied += repack_window(*args, n)
    token_bytes = H * 2 * D * 4
    full = [i for i in range(num_layers) if i not in sliding]
    assert copied == token_bytes * (len(full) * n + len(sliding) * len(window.kept(n)))
    for t in range(n):
        for layer in full:
            assert (pool.staged(layer, blocks, t) == pool.token(layer, pages, t)).all(), t
        for layer in sliding:
            got = pool.staged(layer, blocks, t)
            if t in window.kept(n):
                assert (got == pool.token(layer, entries, t)).all(), (layer, t)
            elif t in window.cleared(n):
                assert (got == 0).all(), (layer, t)
            else:  # a block the sliding group does not send: untouched
                assert (got == GARBAGE).all(), (layer, t)


def test_a_window_page_not_given_or_not_held_is_refused() -> None:
    window = Windowed(3, (0, 2)).window
    n = 40
    pages, entries = _request(n, window, seed=1)
    tokens = range(0, n)
    check_window(window, entries, len(pages), 0, tokens, n)  # held from page 7 on
    with pytest.raises(ValueError, match="not held"):
        check_window(window, [*entries[:8], -1, *entries[9:]], len(pages), 0, tokens, n)
    with pytest.raises(ValueError, match="were not given"):
        check_window(window, (), len(pages), 0, tokens, n)
    early = [-1] * 7  # pages before the window: no sliding page needed, nor any given
    check_window(window, early, 7, 0, range(0, 28), n)
    check_window(window, (), 7, 0, range(0, 28), n)


def _desk(pool: Windowed) -> PullDesk:
    desk = PullDesk(
        pool.staging, pool.pool, HoldTable(30.0, 5.0), Tickets(8), FakeClock(10.0), REPACKER
    )
    desk.groups, desk.window = pool.groups, pool.window
    desk.identities = {"0.34.0": PullIdentity("engine-1", "10.0.0.1", 5601, 7)}
    return desk


def test_the_sender_mirrors_nothing_and_answers_a_block_list_per_group() -> None:
    pool = Windowed(3, (0, 2))
    desk, n = _desk(pool), 70
    pages, entries = _request(n, pool.window, seed=2)
    assert desk.tickets.open(1, "0.34.0")
    sender = VllmSender(desk, 1, n)
    assert sender.poll() is KVPoll.READY
    assert sender.mirror_slots(0, 16) == ()  # the forward writes the sliding pool, not these
    sender.send_pages(pages, 0, entries)
    sender.send_aux(0)
    wait_until(lambda: sender.poll().is_terminal, what="the repacks end")
    assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()
    sender.close()
    params = desk.tickets.take(1)
    assert params is not None
    blocks = list(range(9))  # the lowest free ones
    assert params["remote_block_ids"] == [blocks[-3:], blocks[-3:], blocks]  # [L0] [L2] [L1]
    assert desk.counts.repacked_tokens == n and desk.counts.mirrored_tokens == 0
    desk.close()
    assert desk.staging.num_free == BLOCKS


def test_a_missing_window_page_fails_the_room_and_frees_its_blocks() -> None:
    pool = Windowed(3, (0, 2))
    desk, n = _desk(pool), 70
    pages, entries = _request(n, pool.window, seed=3)
    entries[-1] = -1  # the last page's window entry went missing
    assert desk.tickets.open(2, "0.34.0")
    sender = VllmSender(desk, 2, n)
    assert sender.poll() is KVPoll.READY
    sender.send_pages(pages, 0, entries)
    assert sender.poll() is KVPoll.FAILED
    assert "not held" in (sender.failure_reason() or "")
    assert desk.counts.repacks == 0  # nothing queued
    sender.send_pages(pages, 0, entries)  # a later chunk of a failed room: ignored
    sender.send_aux(0)  # and its last step: it stays failed, nothing held
    assert sender.poll() is KVPoll.FAILED and desk.tickets.take(2) is None
    sender.close()
    assert desk.staging.num_free == BLOCKS
