"""vLLM decodes served straight from the pool: a pool in vLLM's block layout (``kv.layout``
``vllm_blocks``, ``[L, P, KV, page_size, 2 * D]``) is its own staging region, no copy of it.

A page of one layer is one vLLM block of that layer, one contiguous run (page size = the
decodes' block size; at TP > 1 the group's pool, every rank's heads of it, in memory the
ranks share: ``service.vllm_group``), so the pool's per-layer regions are registered with
the vLLM backend's agent and handed out on the side channels as vLLM's ``LBHNC`` regions:
a push WRITEs, and a pull READs, one descriptor per page per layer, straight from the pages
the forward wrote (no staging region, no KV mirror, no repack).
docs/vllm.md, "A pool in vLLM's layout".

The blocks a request's answer names are its own pool pages, in prompt order. Its sender pins
each page as it is handed over (``kv.pins``: one more reference, taken while the request holds
it), so the page outlives the request; the hold table and the pusher then own the pins as
they own staging blocks elsewhere, and every path that frees a staging block (the READs'
notifications, a lease, a WRITE settled or refused, a request that fails, ``close``) unpins.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefill_worker.kv.layout import VLLM_BLOCKS, KVRegions
from prefill_worker.kv.pins import PagePins
from prefill_worker.request import TransferStats
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.vllm.desk import PullDesk
from prefill_worker.transfer.vllm.sender import TicketSender
from prefill_worker.transfer.vllm.shared import GroupStaging
from prefill_worker.transfer.vllm.staging import StagingLayout, StagingRefused, staging_layout


def is_direct(regions: KVRegions) -> bool:
    """Whether vLLM decodes are served from this pool itself (a ``vllm_blocks`` pool)."""
    return regions.layout.kind == VLLM_BLOCKS


class PoolBlocks:
    """The pool as the vLLM backend's block store (``staging.StagingPool``'s part the desk,
    the pusher and the side channel use): block ``b`` of layer ``l`` is page ``b`` of the
    pool's layer ``l``; ``free`` unpins. Blocks are never allocated here: a request's are the
    pages it already holds (``DirectSender``)."""

    def __init__(
        self,
        regions: KVRegions,
        block_size: int,
        pins: PagePins,
        group: GroupStaging | None = None,
    ) -> None:
        """``group``: a tensor-parallel group's shared pool (``service.vllm_group``: every
        rank's pool moved into its heads of it), which the blocks are then, every head."""
        lay = regions.layout
        if lay.kind != VLLM_BLOCKS:
            raise StagingRefused(f"kv layout {lay.kind}: the pool is not in vLLM's blocks")
        if block_size != lay.page_size:
            raise StagingRefused(
                f"vllm_block_size {block_size} with a vllm_blocks pool of {lay.page_size}-token "
                "pages: a page is one vLLM block, set them equal"
            )
        if pins.pool.num_pages != lay.num_pages:
            raise StagingRefused(
                f"pins over {pins.pool.num_pages} pages; the pool has {lay.num_pages}"
            )
        heads = None if group is None else group.num_kv_heads
        self.layout: StagingLayout = staging_layout(regions, block_size, lay.num_pages, heads)
        if group is None:
            assert self.layout.region_bytes == lay.region_bytes, (self.layout, lay)
            self.region_base_addrs: tuple[int, ...] = regions.region_base_addrs  # K‖V a layer
        else:
            size = self.layout.num_layers * self.layout.region_bytes
            assert group.buffer.size == size, (group.buffer.size, size)
            base, step = int(group.buffer.ctypes.data), self.layout.region_bytes
            self.region_base_addrs = tuple(base + i * step for i in range(lay.num_layers))
        self._pins = pins

    @property
    def num_free(self) -> int:
        """Blocks not pinned for decodes (the metrics' "used" is the pinned pages)."""
        return self.layout.num_blocks - self._pins.num_pinned

    def free(self, block_ids: Sequence[int]) -> None:
        self._pins.unpin(block_ids)

    def pin(self, page_ids: Sequence[int]) -> None:
        self._pins.pin(page_ids)


class DirectSender(TicketSender):
    """A vLLM request's ``KVSender`` over a ``vllm_blocks`` pool: its pages, pinned as they are
    handed over, are the blocks its answer names::

        no ticket for the room            BOOTSTRAPPING (another protocol's room)
        ticket                            READY
        send_pages × n                    TRANSFERRING  (the pages pinned)
        send_aux                          SUCCESS       (the pins held under a lease; ticket
                                                         done) or FAILED (the ticket gone)

    ``close`` unpins what is not held yet. Nothing is copied, so the answer goes out with the
    last forward."""

    def __init__(self, desk: PullDesk, blocks: PoolBlocks, room: int, num_tokens: int) -> None:
        super().__init__(desk, room, num_tokens)
        self._blocks = blocks
        self._pages: dict[int, int] = {}  # prompt page index -> pool page, pinned, until held

    def poll(self) -> KVPoll:
        if self._state is KVPoll.BOOTSTRAPPING and self._desk.tickets.is_open(self._room):
            self._state = KVPoll.READY
        return self._state

    def num_cached_tokens(self) -> int:
        return 0

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        assert self._state is not KVPoll.BOOTSTRAPPING, "send_pages before READY"
        if self._state.is_terminal:
            return
        self._state = KVPoll.TRANSFERRING
        fresh = [
            (first_page + i, p) for i, p in enumerate(page_ids) if first_page + i not in self._pages
        ]
        self._blocks.pin([p for _, p in fresh])
        self._pages.update(fresh)

    def send_aux(self, aux_row: int) -> None:
        if self._state.is_terminal:
            return
        need = self._blocks.layout.num_blocks_for(self._num_tokens)
        missing = [i for i in range(need) if i not in self._pages]
        if missing:  # the engine hands every page over before the aux row: a bug if not
            self.fail(f"prompt pages {missing[:4]} were never handed over")
            return
        blocks = tuple(self._pages[i] for i in range(need))
        extra = [p for i, p in self._pages.items() if i >= need]
        self._pages = {}
        if extra:
            self._blocks.free(extra)
        if self._hold(blocks):  # the desk frees them if not
            self._desk.counts.pool_tokens += self._num_tokens

    def transfer_stats(self) -> TransferStats:
        return TransferStats(0)  # nothing copied: the decode READs, or the pusher WRITEs

    def close(self) -> None:
        if self._pages:
            self._blocks.free(list(self._pages.values()))
            self._pages = {}
