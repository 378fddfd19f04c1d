"""Bytes a sliding-window model's prompt sends to a decode that holds a hybrid SWA pool,
over what a full pool's decode receives: ``transfer.swa_window``'s page choice, counted.

Prints ``{"name": "swa_bytes", "tokens", "page_size", "layers", "sliding_layers",
"window_tokens", "window_bytes", "full_pool_bytes", "ratio"}`` per page size. The shape is
gpt-oss-20b's (24 layers alternating sliding and full, sliding_window 128 so a decode keeps
127 tokens, 8 KV heads of 64, bf16); gpt-oss-120b (36 layers) has the same ratio. The numbers
come from the page selection alone (which pages each layer sends; every page of a layer is
the same size): no 32k forward runs and nothing goes over a wire, since no protocol carries
the ``window`` mode yet.

    python bench/swa_bytes.py [--tokens 32768] [--page-sizes 16,64]
"""

from __future__ import annotations

import argparse
import json

from prefill_worker.transfer.swa_window import (
    FULL_POOL,
    WINDOW,
    decode_window_tokens,
    pages_sent,
)

LAYERS, SLIDING_WINDOW, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 24, 128, 8, 64, 2


def row(tokens: int, page_size: int) -> dict[str, object]:
    window = decode_window_tokens(SLIDING_WINDOW)
    windows = [window if i % 2 == 0 else None for i in range(LAYERS)]  # even layers slide
    layer_page = 2 * page_size * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V
    sent = pages_sent(windows, tokens, page_size, 0, WINDOW) * layer_page
    full = pages_sent(windows, tokens, page_size, 0, FULL_POOL) * layer_page
    return {
        "name": "swa_bytes",
        "tokens": tokens,
        "page_size": page_size,
        "layers": LAYERS,
        "sliding_layers": sum(w is not None for w in windows),
        "window_tokens": window,
        "window_bytes": sent,
        "full_pool_bytes": full,
        "ratio": round(sent / full, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--page-sizes", default="16,64")
    args = parser.parse_args()
    for page_size in (int(p) for p in args.page_sizes.split(",")):
        print(json.dumps(row(args.tokens, page_size)), flush=True)


if __name__ == "__main__":
    main()
