"""Pool bytes a sliding-window model's prompt holds with ``cache.sliding_pool: windowed`` over
``full`` (docs/models.md, "The sliding-window pool"): ``kv.sliding``'s bookkeeping, driven
through the prompt's chunks as the engine plans them (the next chunk's pages taken before the
previous chunk's are trimmed: overlapped forwards).

Prints ``{"name": "swa_pool", "tokens", "page_size", "chunk", "layers", "sliding_layers",
"window", "full_pool_bytes", "windowed_bytes", "ratio", "peak_windowed_bytes", "peak_ratio",
"quota_pages"}`` per page size. ``ratio``: what the request holds once its prefill ended (the
full layers' pages and each sliding layer's last window: what it keeps while its KV goes to
the decode); ``peak_ratio``: the most it held while prefilling (the window and two chunks).
The shape is gpt-oss-20b's (24 layers alternating sliding and full, sliding_window 128, 8 KV
heads of 64, bf16). No forward runs: the bytes are pages times one page's K and V.

    python -m bench.swa_pool [--tokens 32768] [--page-sizes 16,64] [--chunk 8192]
"""

from __future__ import annotations

import argparse
import json

from prefill_worker.kv.layout import KVLayout
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.sliding import SlidingPageTable, max_pages_per_request

LAYERS, SLIDING_WINDOW, KV_HEADS, HEAD_DIM = 24, 128, 8, 64
SLIDING = tuple(range(0, LAYERS, 2))


def held_pages(tokens: int, page_size: int, chunk: int) -> tuple[int, int]:
    """(sliding pages held after the prefill, the most held during it)."""
    quota = max_pages_per_request(SLIDING_WINDOW, chunk, page_size)
    table = SlidingPageTable(PagePool(quota), page_size, SLIDING_WINDOW, chunk)
    assert table.try_reserve("r", tokens)
    peak, previous = 0, None
    for start in range(0, tokens, chunk):
        table.pages_for("r", start, min(start + chunk, tokens))
        peak = max(peak, table.pool.num_used)  # the previous chunk's still held
        if previous is not None:
            table.chunk_done("r", previous)
        previous = min(start + chunk, tokens)
    assert previous is not None
    table.chunk_done("r", previous)
    return table.pool.num_used, peak


def row(tokens: int, page_size: int, chunk: int) -> dict[str, object]:
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, "bfloat16", page_size, 1)
    layer_page = 2 * layout.page_bytes  # K and V of one layer's page
    num_pages = -(-tokens // page_size)
    full_bytes = num_pages * LAYERS * layer_page
    num_full = LAYERS - len(SLIDING)
    end, peak = held_pages(tokens, page_size, chunk)
    windowed = (num_pages * num_full + end * len(SLIDING)) * layer_page
    peak_bytes = (num_pages * num_full + peak * len(SLIDING)) * layer_page
    return {
        "name": "swa_pool",
        "tokens": tokens,
        "page_size": page_size,
        "chunk": chunk,
        "layers": LAYERS,
        "sliding_layers": len(SLIDING),
        "window": SLIDING_WINDOW,
        "full_pool_bytes": full_bytes,
        "windowed_bytes": windowed,
        "ratio": round(windowed / full_bytes, 4),
        "peak_windowed_bytes": peak_bytes,
        "peak_ratio": round(peak_bytes / full_bytes, 4),
        "quota_pages": max_pages_per_request(SLIDING_WINDOW, chunk, page_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--page-sizes", default="16,64")
    parser.add_argument("--chunk", type=int, default=8192)
    args = parser.parse_args()
    for page_size in (int(p) for p in args.page_sizes.split(",")):
        print(json.dumps(row(args.tokens, page_size, args.chunk)))


if __name__ == "__main__":
    main()
