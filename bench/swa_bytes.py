"""Bytes a sliding-window model's prompt sends to a decode that holds a hybrid SWA pool,
over what a full pool's decode receives: ``transfer.swa_window``'s page choice, counted.

Prints ``{"name": "swa_bytes", "tokens", "page_size", "layers", "sliding_layers",
"window_tokens", "window_bytes", "sglang_route_bytes", "full_pool_bytes", "ratio"}`` per
page size. The shape is gpt-oss-20b's (24 layers alternating sliding and full,
sliding_window 128 so a decode keeps 127 tokens, 8 KV heads of 64, bf16); gpt-oss-120b (36
layers) has the same ratio. ``window_bytes`` comes from the page selection alone (which pages
each layer sends; every page of a layer is the same size); ``sglang_route_bytes`` is what
SGLang's protocol posts to a decode with a hybrid SWA pool (``transfer/sglang/swa.py``'s
``WindowRoute``, the descriptors of every part of every page, the prompt sent in chunks of
``--chunk`` tokens), which tests/interop/test_swa_landing.py counts landing byte for byte at
a small shape. ``vllm_read_bytes`` is what a vLLM 0.34 decode of ``--vllm-block-size`` READs
(its KV-cache groups: a full group's every block, a sliding group's last ``cdiv(128, bs) + 1``,
``transfer/vllm/groups.py``), the same from a full or a windowed pool; ``vllm_repack_bytes``
what a windowed worker copies into its staging blocks for it (the full layers' every token, the
sliding layers' held window: ``transfer/vllm/window_staging.py``), where a full pool's worker
copies (or mirrors) every layer's every token; tests/interop/test_vllm_hybrid.py checks the
landing at a small shape. No 32k forward runs and nothing goes over a wire here.

    python bench/swa_bytes.py [--tokens 32768] [--page-sizes 16,64] [--chunk 8192]
                              [--vllm-block-size 16]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from prefill_worker.transfer.sglang.swa import WindowRoute, WindowWant
from prefill_worker.transfer.swa_window import (
    FULL_POOL,
    WINDOW,
    SlidingLayers,
    decode_window_tokens,
    layer_pages,
    pages_sent,
)
from prefill_worker.transfer.vllm.groups import sliding_groups
from prefill_worker.transfer.vllm.window_staging import staged_window

LAYERS, SLIDING_WINDOW, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 24, 128, 8, 64, 2
TOKEN_LAYER_BYTES = 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # one token's K and V in one layer


def vllm_bytes(tokens: int, page_size: int, block_size: int, window: int) -> tuple[int, int]:
    """(bytes a vLLM 0.34 decode READs, bytes a windowed worker's repack copies)."""
    sliding = SlidingLayers(tuple(range(0, LAYERS, 2)), LAYERS, window)
    groups = sliding_groups(sliding, "GptOssForCausalLM", block_size)
    blocks = groups.block_ids(range(-(-tokens // block_size)))
    read = sum(len(blocks[g]) for g in groups.layer_group) * block_size * TOKEN_LAYER_BYTES
    kept = len(staged_window(sliding, groups, page_size, block_size).kept(tokens))
    full_layers = LAYERS - len(sliding.sliding)
    repack = (full_layers * tokens + len(sliding.sliding) * kept) * TOKEN_LAYER_BYTES
    return read, repack


def route_bytes(tokens: int, page_size: int, chunk: int, window: int) -> int:
    """Bytes SGLang's window route posts for the prompt (every page a decode page of its own,
    sent chunk by chunk as the engine does)."""
    sliding = SlidingLayers(tuple(range(0, LAYERS, 2)), LAYERS, window)
    num_pages = -(-tokens // page_size)
    num_window = len(layer_pages(tokens, page_size, 0, window, WINDOW))
    route = WindowRoute(sliding, num_pages, num_pages, num_window, page_size)
    pages = np.arange(num_pages, dtype="<i4")
    want = WindowWant(
        1, pages.tobytes(), 0, 0, packed_dst_window_pages=pages[:num_window].tobytes()
    )
    assert route.check(want, tokens) is None
    region_page = page_size * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K or V of one layer's page
    step, sent = max(1, chunk // page_size), 0
    for first in range(0, num_pages, step):
        src = pages[first : first + step]
        for part in route.writes(want, tokens, src, src, first):
            sent += len(part.local) * region_page
    return sent


def row(tokens: int, page_size: int, chunk: int = 8192, block_size: int = 16) -> dict[str, object]:
    window = decode_window_tokens(SLIDING_WINDOW)
    windows = [window if i % 2 == 0 else None for i in range(LAYERS)]  # even layers slide
    layer_page = 2 * page_size * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V
    sent = pages_sent(windows, tokens, page_size, 0, WINDOW) * layer_page
    full = pages_sent(windows, tokens, page_size, 0, FULL_POOL) * layer_page
    vllm_read, vllm_repack = vllm_bytes(tokens, page_size, block_size, window)
    return {
        "name": "swa_bytes",
        "tokens": tokens,
        "page_size": page_size,
        "layers": LAYERS,
        "sliding_layers": sum(w is not None for w in windows),
        "window_tokens": window,
        "window_bytes": sent,
        "sglang_route_bytes": route_bytes(tokens, page_size, chunk, window),
        "full_pool_bytes": full,
        "ratio": round(sent / full, 4),
        "vllm_block_size": block_size,
        "vllm_read_bytes": vllm_read,
        "vllm_repack_bytes": vllm_repack,
        "vllm_ratio": round(vllm_read / full, 4),
        "vllm_repack_ratio": round(vllm_repack / (LAYERS * tokens * TOKEN_LAYER_BYTES), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--page-sizes", default="16,64")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--vllm-block-size", type=int, default=16)
    args = parser.parse_args()
    for page_size in (int(p) for p in args.page_sizes.split(",")):
        line = row(args.tokens, page_size, args.chunk, args.vllm_block_size)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
