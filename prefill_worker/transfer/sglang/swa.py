"""An SGLang decode with a hybrid SWA pool (its ``swa`` state component; gpt-oss): what such
a decode registers and asks, checked, and where each page region of ours goes.

SGLang 0.5.23 runs a hybrid sliding-window model on ``SWAKVPool`` (``mem_cache/
swa_memory_pool.py``) unless started with ``--disable-hybrid-swa-memory``: its KV list holds
the full-attention layers only (K of each, then V), and the sliding layers' K and V are one
state component of page-sized items in a pool of their own, registered once
(``setup_state_kv_args``: ``state_types [swa]``, one buffer per sliding layer's K then V, no
dims or layer ids). Per request the decode names the full layers' pages as usual and, as
``state_indices[0]``, the SWA pool's pages for the window, ``[floor_page(max(prefix,
seq_len - window)), seq_len)`` (``decode.py``, ``_swa_payload``); the prefill writes its own
window pages there, position by position (``prefill.py`` and ``nixl/conn.py``,
``maybe_send_extra``). So from our one pool (every layer, every page)::

    our region                        -> the decode's
    K, V of a full layer, prompt page -> its KV list, the page the request names
    K, V of a sliding layer, page q   -> its SWA pool, window page q - first window page
                                         (pages before the window: not sent)

Only gpt-oss among the served families runs on it (``HYBRID_SWA_ARCHITECTURES``, SGLang's
``is_hybrid_swa_model``; Gemma 3 is not, so its decodes hold the full pool). A decode rank of
attention TP > 1 holds its heads of each SWA page, as of each KV page: a worker rank writes
it the same head slice into both (whole pages when the slice is the page; else token runs,
the sender's, ``push/sender.py``); the other ranks of a worker's TP group write theirs from
the registration and want the leader mirrors (``sglang.desk``, ``nixl/rank_backend.py``).
A decode rank of other heads than the worker rank's at a worker with a windowed sliding pool
(``windowed_slices``: the desk's check, where the head slice is known), an older decode (no
``state_data_lens``: the pool's size unknown) or any other state layout is refused by name.
A decode without one gets every layer's pages (``swa_window.FULL_POOL``), as a dense
model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.state_layout import PAGES, StateComponent, StateRegions, StateTensor
from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.state_lists import StateLists
from prefill_worker.transfer.pagemap import region_indices
from prefill_worker.transfer.push.peer import RoutedWrite
from prefill_worker.transfer.push.window_route import (
    layer_planes,
    local_offsets,
    region_at,
    token_runs,
    window_sources,
)
from prefill_worker.transfer.sglang.accept import rank_layout
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest
from prefill_worker.transfer.swa_window import (
    SWA_KIND,
    WINDOW,
    SlidingLayers,
    WindowWant,
    layer_pages,
    window_slots,
)
from prefill_worker.transfer.validate import (
    BootstrapLimits,
    Refusal,
    RejectReason,
    outside_address_space,
)

HYBRID_SWA_ARCHITECTURES = frozenset({"GptOssForCausalLM"})


@dataclasses.dataclass(frozen=True, slots=True)
class WindowPool:
    """An accepted registration with a hybrid SWA pool: the registration as its KV list
    alone (the full layers, no state) with our layout of those layers, to check and map as
    any decode's; and its SWA pool, as a state component's regions."""

    registration: Registration
    layout: KVLayout
    swa: StateRegions


def accept_window(
    reg: Registration, ours: KVLayout, sliding: SlidingLayers, limits: BootstrapLimits
) -> WindowPool | Refusal:
    """The decode's hybrid SWA pool, or why it cannot take this model's sliding layers
    (``ours``: our layout of the model's every head; a decode rank holds its own)."""
    if len(reg.state) != 1:
        return _unsupported(
            f"the decode registered {len(reg.state)} state components; this model's decode "
            "holds one (swa: its sliding layers' K and V)"
        )
    swa = reg.state[0]
    num_buffers = 2 * len(sliding.sliding)
    if swa.dims or swa.layer_ids:
        return _unsupported("the decode's state component is not a hybrid SWA pool")
    if len(swa.data_ptrs) != num_buffers or len(swa.item_lens) != num_buffers:
        why = (
            f"decode registered {len(swa.data_ptrs)} SWA buffers; this model has "
            f"{len(sliding.sliding)} sliding layers ({num_buffers}: K and V of each)"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    page_bytes = rank_layout(reg, ours).page_bytes  # its heads of a page
    if set(swa.item_lens) != {page_bytes}:
        why = (
            f"decode SWA page is {sorted(set(swa.item_lens))} bytes; this worker's is "
            f"{page_bytes}: the page size, KV dtype or head layout differ"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    return _window_pool(reg, ours, sliding, limits)


def _window_pool(
    reg: Registration, ours: KVLayout, sliding: SlidingLayers, limits: BootstrapLimits
) -> WindowPool | Refusal:
    swa = reg.state[0]
    if len(swa.data_lens) != len(swa.data_ptrs) or len(set(swa.data_lens)) != 1:
        return _unsupported(
            "the decode's SWA buffers come without one size for all (state_data_lens, sent "
            "from SGLang 0.5.23 on)"
        )
    theirs = rank_layout(reg, ours)  # its heads of each page
    num_items = swa.data_lens[0] // theirs.page_bytes
    if not 1 <= num_items <= limits.max_peer_pages:
        why = (
            f"decode SWA pool of {num_items} pages; this worker takes 1 to "
            f"{limits.max_peer_pages} (transfer.max_peer_pages)"
        )
        return Refusal(RejectReason.TOO_LARGE, why)
    region_bytes = num_items * theirs.page_bytes
    refusal = outside_address_space("SWA region", [(a, region_bytes) for a in swa.data_ptrs])
    if refusal is not None:
        return refusal
    full = dataclasses.replace(ours, num_layers=len(sliding.full))
    page = (theirs.page_size, theirs.num_kv_heads, theirs.head_dim)
    tensors = tuple(StateTensor(n, page, ours.dtype, theirs.page_bytes) for n in ("k", "v"))
    component = StateComponent(SWA_KIND, sliding.sliding, tensors, num_items, PAGES)
    half = len(sliding.sliding)
    bases = (swa.data_ptrs[:half], swa.data_ptrs[half:])
    device = "cpu" if reg.mem_kinds[:1] == ("DRAM",) else f"cuda:{reg.gpu_id}"
    kv_only = dataclasses.replace(reg, has_state=False, state=())
    return WindowPool(kv_only, full, StateRegions(component, bases, device))


def window_want(req: TransferRequest) -> WindowWant | Refusal:
    """The request's want with its SWA window pages (its one state component's indices)."""
    if len(req.state_indices) != 1:
        why = (
            f"the request names {len(req.state_indices)} state index lists; a decode with a "
            "hybrid SWA pool names one (its window pages)"
        )
        return _unsupported(why)
    want = req.want()
    window = np.asarray(req.state_indices[0], dtype="<i4").tobytes()
    return WindowWant(
        want.room,
        want.packed_dst_page_ids,
        want.dst_aux_slot,
        want.num_cached_tokens,
        packed_dst_window_pages=window,
    )


def window_route(
    sliding: SlidingLayers | None,
    ours: KVLayout,
    peer: KVRegions,
    swa: StateLists | None,
    is_whole: bool = True,
) -> WindowRoute | None:
    """Where a decode with a hybrid SWA pool (``swa``; None: it has none) takes each of our
    regions; ``peer`` is its KV list; whole pages (``is_whole``: the decode rank's heads are
    ours), else a head slice's token runs."""
    if swa is None or sliding is None:
        return None
    swa_pages = swa.regions.component.num_items
    peer_pages, page_size = peer.layout.num_pages, ours.page_size
    runs = 1 if is_whole else page_size
    return WindowRoute(sliding, ours.num_pages, peer_pages, swa_pages, page_size, runs)


class WindowRoute:
    """``PageRoute`` of one decode with a hybrid SWA pool; ``local_pages`` is our pool's page
    count, ``peer_pages`` its KV list's, ``swa_pages`` its SWA pool's. With a windowed
    sliding pool (``sliding.pool_pages``) a sliding layer's window pages are read from the
    request's sliding pages (``writes``' ``sliding``), in the sliding layers' own regions.
    Whole pages (``runs`` 1), or a head slice's token runs (``runs`` page_size: every list
    ``headplan.slice_table``'s, ``window_route.token_runs``)."""

    def __init__(
        self,
        sliding: SlidingLayers,
        local_pages: int,
        peer_pages: int,
        swa_pages: int,
        page_size: int,
        runs: int = 1,
    ) -> None:
        full, slide = layer_planes(sliding)
        self._num_full, self._num_sliding = len(full), len(slide)
        self._window_tokens, self._page_size = sliding.window_tokens, page_size
        self._peer_pages, self._swa_pages = peer_pages, swa_pages
        offsets = local_offsets(sliding, local_pages)
        self._full_at, self._sliding_at = offsets[full], offsets[slide]
        self.is_windowed, self._runs = sliding.pool_pages > 0, runs

    def window(self, want: wire.Want, num_prompt_tokens: int) -> range:
        """The prompt pages whose sliding layers the decode keeps."""
        return layer_pages(
            num_prompt_tokens,
            self._page_size,
            want.num_cached_tokens,
            self._window_tokens,
            WINDOW,
        )

    def check(self, want: wire.Want, num_prompt_tokens: int) -> str | None:
        if not isinstance(want, WindowWant):
            return "the request names no SWA pages, which the decode's hybrid SWA pool needs"
        ids, needed = want.dst_window_pages, len(self.window(want, num_prompt_tokens))
        if len(ids) != needed:
            return f"the request names {len(ids)} SWA pages, the window needs {needed}"
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self._swa_pages):
            return f"SWA pages outside the decode's SWA pool of {self._swa_pages} pages"
        if np.unique(ids).size != ids.size:
            return "the request's SWA pages repeat a page"
        return None

    def writes(
        self,
        want: wire.Want,
        num_prompt_tokens: int,
        src: np.ndarray,
        dst: np.ndarray,
        first_page: int,
        sliding: np.ndarray | None = None,
    ) -> Sequence[RoutedWrite]:
        assert isinstance(want, WindowWant), "checked at bind"
        runs = self._runs
        full = RoutedWrite(
            token_runs(region_at(self._full_at, src), runs),
            token_runs(region_indices(dst, self._num_full, self._peer_pages), runs),
            is_state=False,
        )
        window = self.window(want, num_prompt_tokens)
        kept, swa_dst = window_slots(want.dst_window_pages, window.stop, first_page, len(src))
        # a windowed pool: the window's own pages (``kv.sliding``: held until release)
        swa_src = window_sources(sliding, len(src), kept) if self.is_windowed else src[kept]
        part = RoutedWrite(
            token_runs(region_at(self._sliding_at, swa_src), runs),
            token_runs(region_indices(swa_dst, self._num_sliding, self._swa_pages), runs),
            is_state=True,
        )
        return (full, part)


def windowed_full_pool() -> str:
    """Why a decode without a hybrid SWA pool is refused by a windowed worker."""
    return (
        "the decode holds every sliding layer's pages (hybrid SWA memory off); this worker "
        "keeps its sliding layers' last window only (cache.sliding_pool windowed): start the "
        "decode without --disable-hybrid-swa-memory, or the worker with sliding_pool full"
    )


def windowed_slices() -> str:
    """Why a decode rank holding other heads than ours (a decode of another attention TP)
    with a hybrid SWA pool is refused by a windowed worker."""
    return (
        "a decode rank of other KV heads than this worker rank's with a hybrid SWA pool, at a "
        "worker with a windowed sliding pool (its heads' token runs of that pool are not "
        "built): run the decode at the worker's attention TP, or the worker with "
        "cache.sliding_pool full"
    )


def _unsupported(why: str) -> Refusal:
    return Refusal(RejectReason.UNSUPPORTED, why)
