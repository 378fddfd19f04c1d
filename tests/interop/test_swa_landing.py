"""A sliding-window model (gpt-oss's layer map) to SGLang 0.5.23's own decode, byte for byte,
with hybrid SWA memory on and off.

On: the decode's ``SWAKVPool`` (built as its decode builds one for gpt-oss, its state
component registered by SGLang's ``setup_state_kv_args``, its window pages named as its
``decode.py`` names them). The full layers' pages land in its full pool at the pages it asked
for; the sliding layers' window pages (``[floor_page(max(prefix, len - window)), len)``) land
in its SWA pool at its SWA pages, in order; nothing before the window is sent, no held page is
written. Off (``--disable-hybrid-swa-memory``: an ``MHATokenToKVPool`` of every layer): every
layer's pages land as a dense model's. Prompts longer than the window, in chunks, with and
without a decode-held prefix, pages of 16 and of 1; the worker's pools whole afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.request import TransferStats
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from prefill_worker.transfer.sglang import aux
from prefill_worker.transfer.swa_window import (
    FULL_POOL,
    WINDOW,
    SlidingLayers,
    layer_pages,
    pages_sent,
)
from tests.interop.decodes import SglangDecode, dump
from tests.interop.rig import PrefillRig, push

pytestmark = pytest.mark.interop

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 5, 2, 16
SLIDING = (0, 2, 3)  # gpt-oss alternates; an odd map shows a layer sent to the wrong pool
FULL = (1, 4)
WINDOW_TOKENS = 23  # gpt-oss's sliding_window 24: SGLang's decode keeps 23
WORKER_PAGES, DECODE_PAGES, SWA_PAGES = 96, 128, 80  # rooms keep theirs: held ones are fresh


class SlidingWorker(PrefillRig):
    """The rig over a layer-major pool of a sliding-window model's every layer: K of layer l
    is region l, V region n + l."""

    def __init__(self, layout: KVLayout) -> None:
        sliding = SlidingLayers(SLIDING, NUM_LAYERS, WINDOW_TOKENS)
        super().__init__(layout, 7, "prefill-swa", sliding=sliding)

    def regions(self) -> KVRegions:
        base, n, lay = int(self.pool.ctypes.data), self.layout.num_layers, self.layout
        starts = [base + r * lay.num_pages * lay.page_bytes for r in range(2 * n)]
        return KVRegions(lay, tuple(starts[:n]), tuple(starts[n:]), "cpu", self.aux.base_addr, 8)

    def page(self, region: int, page: int) -> np.ndarray:
        lay = self.layout
        start = (region * lay.num_pages + page) * lay.page_bytes
        return self.pool[start : start + lay.page_bytes]


@pytest.fixture
def sglang_0_5_23(decode_process: SglangDecodeProcess, sglang_version: str) -> SglangDecodeProcess:
    if sglang_version != "0.5.23":
        pytest.skip("SGLang's state_data_lens (the SWA pool's size) come from 0.5.23 on")
    return decode_process


@pytest.mark.parametrize(("dtype", "page_size"), [("float32", 16), ("bfloat16", 1)])
def test_hybrid_swa_memory_on_and_off(
    sglang_0_5_23: SglangDecodeProcess, tmp_path: Path, dtype: str, page_size: int
) -> None:
    layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype, page_size, WORKER_PAGES)
    worker = SlidingWorker(layout)
    try:
        full_layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype, page_size, DECODE_PAGES)
        swa = SglangDecode(
            sglang_0_5_23, worker.bootstrap, full_layout, swa=(SLIDING, WINDOW_TOKENS, SWA_PAGES)
        )
        dense = SglangDecode(sglang_0_5_23, worker.bootstrap, full_layout)
        # Past the window either way; a held prefix before the window (pages of 16: 48 of 72
        # tokens, the window starts at 49) and one into it (pages of 1: 24 of 40, past 17).
        tokens, held = (72, 3) if page_size == 16 else (40, 24)
        cases = [(tokens, 0, 2), (tokens, held, 3), (20, 0, 1)]
        rng = np.random.default_rng(3)
        for num_tokens, num_held, chunk_pages in cases:
            landed_bytes = []
            for decode in (swa, dense):
                room = int(rng.integers(1, 2**63))
                decode.want(room, num_tokens, num_held * page_size)
                stats: list[TransferStats] = []
                _, src = push(worker, room, num_tokens, chunk_pages, stats)
                landed_bytes.append(stats[0].bytes - aux.ROW_DTYPE.itemsize)
                assert decode.wait(room) == ("Success", None)
                landed = dump(decode, room, tmp_path)
                if decode is swa:
                    check_window(worker, landed, src, num_tokens, num_held, swa.swa_pages[room])
                else:
                    check_layers(worker, landed, src, range(NUM_LAYERS), num_held)
            # What landed is what the page choice (bench/swa_bytes.py's) counts, both modes.
            windows = [WINDOW_TOKENS if i in SLIDING else None for i in range(NUM_LAYERS)]
            layer_page = 2 * layout.page_bytes  # K and V
            expected = [
                pages_sent(windows, num_tokens, page_size, num_held * page_size, mode) * layer_page
                for mode in (WINDOW, FULL_POOL)
            ]
            assert landed_bytes == expected
        assert swa.swa_pages and all(len(p) for p in swa.swa_pages.values())
    finally:
        worker.backend.close()
    worker.check_whole()


def check_window(
    worker: SlidingWorker,
    landed: dict[str, np.ndarray],
    src: list[int],
    num_tokens: int,
    num_held: int,
    swa_pages: list[int],
) -> None:
    """Full layers as a dense model's; each sliding layer's window pages in the SWA pool."""
    check_layers(worker, landed, src, FULL, num_held)
    size = worker.layout.page_size
    window = layer_pages(num_tokens, size, num_held * size, WINDOW_TOKENS, WINDOW)
    assert len(swa_pages) == len(window) > 0
    for j, layer in enumerate(SLIDING):
        for kind, region in (("k", layer), ("v", NUM_LAYERS + layer)):
            got = landed[f"swa_{kind}{j}"]
            for i, page in enumerate(window):
                want = worker.page(region, src[page])
                assert np.array_equal(got[i], want), f"window page {page} ({kind}{layer})"


def check_layers(
    worker: SlidingWorker,
    landed: dict[str, np.ndarray],
    src: list[int],
    layers: tuple[int, ...] | range,
    num_held: int,
) -> None:
    """The decode's KV pool holds ``layers`` in order: every prompt page after the held ones
    is ours, the held ones untouched."""
    for index, layer in enumerate(layers):
        for kind, region in (("k", layer), ("v", NUM_LAYERS + layer)):
            got = landed[f"{kind}{index}"]
            for i in range(len(src)):
                if i < num_held:
                    assert (got[i] == FILL_BYTE).all(), f"held page {i} written ({kind}{layer})"
                else:
                    assert np.array_equal(got[i], worker.page(region, src[i])), (i, kind, layer)
