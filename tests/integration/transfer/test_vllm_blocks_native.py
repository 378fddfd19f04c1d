"""A native push between two ``vllm_blocks`` pools (vLLM's LBHNC blocks on both sides, real
NIXL): whole pages, one descriptor run per page per layer, land byte for byte where the decode
asked, and the worker's pool is untouched; a decode of another layout is refused, naming both
(the compatibility hash covers ``kind``)."""

from __future__ import annotations

import numpy as np
import pytest

from prefill_worker.kv.layout import LAYER_MAJOR, VLLM_BLOCKS
from tests.integration.transfer.conftest import Worker, small_spec
from tests.integration.transfer.test_nixl_transfer import push


def _region_page(buf: np.ndarray, worker: Worker, layer: int, page: int) -> np.ndarray:
    lay = worker.spec.layout
    at = layer * lay.region_bytes + page * lay.region_page_bytes
    return buf[at : at + lay.region_page_bytes]


def test_whole_vllm_blocks_pages_land_where_the_decode_asked(decodes, pool_layout) -> None:
    if pool_layout != LAYER_MAJOR:
        pytest.skip("once: this test picks its own layout")
    spec = small_spec("bfloat16", VLLM_BLOCKS)
    worker = Worker(spec)
    try:
        decode = decodes(worker)
        assert decode.call("registered", 10.0) is None
        owned = worker.alloc(spec.layout.num_pages)
        src, dst = [17, 3, 9, 4, 20], [2, 11, 5, 6]  # the first page cached on the decode
        before = decode.pool.copy()
        push(worker, decode, 77, 19, 4, dst, src, 2, 1, True)
        want = before.copy()
        for layer in range(spec.layout.num_layers):
            for s, d in zip(src[1:], dst, strict=True):
                _region_page(want, worker, layer, d)[:] = _region_page(
                    worker.pool, worker, layer, s
                )
        kv_bytes = spec.layout.pool_bytes
        assert np.array_equal(decode.pool[:kv_bytes], want[:kv_bytes])
        worker.pages.free(owned)
        worker.check_whole()
        other = decodes(worker, small_spec("bfloat16", LAYER_MAJOR))
        refused = other.call("registered", 10.0)
        assert refused is not None and "vllm_blocks" in str(refused), refused
    finally:
        worker.backend.close()
