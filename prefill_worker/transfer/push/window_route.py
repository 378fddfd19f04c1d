"""A windowed sliding pool's pages as a push reads them (``cache.sliding_pool windowed``):
where each of our regions' pages sit in our per-layer descriptor list (a sliding layer's
region holds ``SlidingLayers.pool_pages`` pages, not the pool's), which of a request's
sliding pages hold its window (``window_sources``: the one seam every protocol's route
reads a sliding layer's window from), and ``FullPoolWindow``, the ``PageRoute`` of a decode
whose pool holds every layer at every position (the native decode): its full layers get
every page, its sliding layers the pages of the window a decode reads
(``swa_window.layer_pages``, ``WINDOW``) from our sliding pages, into the decode's pages of
the same positions. Its pages before the window are not written: a decode's sliding layer
never reads them. A decode rank taking a head slice of each token (``transfer.headplan``:
a decode of another TP size than ours) is written the same pages through token-run lists,
``runs`` (page_size) descriptors a page on both sides (``token_runs``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefill_worker.transfer import wire
from prefill_worker.transfer.push.peer import RoutedWrite
from prefill_worker.transfer.swa_window import WINDOW, SlidingLayers, layer_pages


def local_offsets(sliding: SlidingLayers, local_pages: int) -> np.ndarray:
    """Each of our 2L regions' first index in our per-layer list (``pagemap.
    layer_view_table``): ``local_pages`` each, or a windowed sliding pool's sliding layers
    ``sliding.pool_pages`` (``KVRegions.layer_pages``)."""
    counts = [
        sliding.pool_pages if sliding.pool_pages and i in sliding.sliding else local_pages
        for i in range(sliding.num_layers)
    ] * 2
    return (np.cumsum(counts) - np.asarray(counts)).astype(np.int32)


def layer_planes(sliding: SlidingLayers) -> tuple[np.ndarray, np.ndarray]:
    """The regions (K planes, then V planes: layer ``i``'s are ``i`` and ``num_layers + i``)
    of the full layers and of the sliding layers."""
    n = sliding.num_layers

    def planes(layers: Sequence[int]) -> np.ndarray:
        return np.array([*layers, *(n + i for i in layers)], np.int32)

    return planes(sliding.full), planes(sliding.sliding)


def region_at(offsets: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """Descriptor indices of ``pages`` in each region starting at ``offsets``,
    region-major."""
    return np.add.outer(offsets, np.asarray(pages, dtype=np.int32)).ravel()


def token_runs(indices: np.ndarray, runs: int) -> np.ndarray:
    """Page descriptor indices as indices of a list of ``runs`` descriptors a page (its
    token runs, ``headplan.slice_table``), each page's runs in order; ``runs`` 1: as they
    are."""
    if runs == 1:
        return indices
    return np.add.outer(indices * runs, np.arange(runs, dtype=np.int32)).ravel()


def window_sources(sliding: np.ndarray | None, num_pages: int, kept: np.ndarray) -> np.ndarray:
    """The sliding-pool pages holding a chunk's window pages (``kept`` of its
    ``num_pages``), from the chunk's sliding entries (``KVSender.send_pages``'
    ``sliding_page_ids``); ``ValueError`` when they are missing or one is not held."""
    if sliding is None or len(sliding) != num_pages:
        raise ValueError("a windowed sliding pool's pages were not given with the chunk")
    pages = np.asarray(sliding)[kept]
    if pages.size and int(pages.min()) < 0:
        raise ValueError("a window page of the sliding pool is not held")
    return pages


def full_pool_route(
    sliding: SlidingLayers | None, local_pages: int, peer_pages: int, page_size: int, is_whole: bool
) -> FullPoolWindow | None:
    """The route into a decode rank holding every layer, for a windowed sliding pool (None
    without one): whole pages (``is_whole``: its head slice is every head of ours and its),
    else the slice's token runs."""
    if sliding is None or not sliding.pool_pages:
        return None
    return FullPoolWindow(sliding, local_pages, peer_pages, page_size, 1 if is_whole else page_size)


def chunk_writes(
    route: FullPoolWindow,
    want: wire.Want,
    num_prompt_tokens: int,
    chunk: tuple[Sequence[int], int, Sequence[int]],
    src: np.ndarray,
    dst: np.ndarray,
) -> Sequence[RoutedWrite]:
    """``route.writes`` of a chunk (its ``page_ids``, ``first_page`` and sliding entries, as
    ``KVSender.send_pages`` takes them) of which ``src`` are the pages the decode lacks (the
    last ones: ``pagemap.map_pages``)."""
    page_ids, first_page, sliding_page_ids = chunk
    skipped = len(page_ids) - len(src)
    sliding = np.asarray(sliding_page_ids[skipped:])  # none given: window_sources says so
    return route.writes(want, num_prompt_tokens, src, dst, first_page + skipped, sliding)


class FullPoolWindow:
    """``PageRoute`` of a decode holding every layer's K/V at every position (its list
    ``peer_pages`` per region), fed from a windowed sliding pool: whole pages (``runs`` 1),
    or a head slice's token runs (``runs`` page_size, both lists ``headplan.slice_table``'s)."""

    def __init__(
        self,
        sliding: SlidingLayers,
        local_pages: int,
        peer_pages: int,
        page_size: int,
        runs: int = 1,
    ) -> None:
        if not sliding.pool_pages:
            raise ValueError("FullPoolWindow: a route of a windowed sliding pool only")
        if runs not in (1, page_size):
            raise ValueError(f"FullPoolWindow: {runs} runs a page of {page_size} tokens")
        full, slide = layer_planes(sliding)
        offsets = local_offsets(sliding, local_pages)
        self._full_at, self._sliding_at = offsets[full], offsets[slide]
        self._full_peer, self._sliding_peer = full * peer_pages, slide * peer_pages
        self._window_tokens, self._page_size, self._runs = sliding.window_tokens, page_size, runs

    def window(self, want: wire.Want, num_prompt_tokens: int) -> range:
        """The prompt pages whose sliding layers the decode reads."""
        prefix = want.num_cached_tokens
        return layer_pages(num_prompt_tokens, self._page_size, prefix, self._window_tokens, WINDOW)

    def check(self, want: wire.Want, num_prompt_tokens: int) -> str | None:
        return None  # its pages are checked as every want's (``pagemap.check_want``)

    def writes(
        self,
        want: wire.Want,
        num_prompt_tokens: int,
        src: np.ndarray,
        dst: np.ndarray,
        first_page: int,
        sliding: np.ndarray | None = None,
    ) -> Sequence[RoutedWrite]:
        dst, runs = np.asarray(dst), self._runs  # region_at makes the indices int32
        full = RoutedWrite(
            token_runs(region_at(self._full_at, src), runs),
            token_runs(region_at(self._full_peer, dst), runs),
            False,
        )
        start = self.window(want, num_prompt_tokens).start
        kept = np.arange(first_page, first_page + len(src)) >= start
        pages = window_sources(sliding, len(src), kept)
        part = RoutedWrite(
            token_runs(region_at(self._sliding_at, pages), runs),
            token_runs(region_at(self._sliding_peer, dst[kept]), runs),
            False,
        )
        return (full, part)
