"""Write a decode integration: receive prompts' KV and first tokens from a prefill worker.

The walkthrough in docs/protocol.md ("Write a decode integration"), runnable against a live
worker; it plays the router too, so it needs the worker's ingress address as well:

    python examples/decode_integration.py --bootstrap tcp://127.0.0.1:5558 \\
        --ingress tcp://127.0.0.1:5557 [--prompts 3] [--asyncio]

1. Ask the worker what its KV pool looks like (``describe_worker``; ``GET /readyz`` has the
   same as ``kv_layout``), and allocate a decode pool of that layout.
2. Register the pool (``KVReceiver.from_tensors``, with the receiver's own I/O thread, so the
   engine thread below only calls ``want``/``wait``/``read_aux``).
3. Per request: pick pages (``num_want_pages`` of them), ``want`` the room, let the router
   send the prompt naming the room, ``wait`` for the room (``await wait_async`` in asyncio),
   read the first token from the aux row, use the KV, ``forget`` the room.

Prints one line per prompt: the room's state, the first token, and how many pages landed.
Exit status 0 when every room is DONE.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import torch

from prefill_worker.ingress import BlockingRouterClient
from prefill_worker.kv.layout import KVLayout
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker, num_want_pages

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def allocate_pool(
    layout: KVLayout, num_pages: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V views ``[num_pages, page_size, KV, D]`` of one pool tensor in the
    worker's layout: ``[L, 2, P, ...]`` (layer_major) or ``[P, L, 2, ...]`` (page_major); an
    MLA model's (mla) is one latent per layer, ``[L, P, page_size, 1, latent]``, and no V."""
    page = (layout.page_size, layout.num_kv_heads, layout.head_dim)
    dtype, num_layers = TORCH_DTYPES[layout.dtype], layout.num_layers
    if layout.kind == "mla":
        return list(torch.zeros((num_layers, num_pages, *page), dtype=dtype)), []
    if layout.kind == "layer_major":
        pool = torch.zeros((num_layers, 2, num_pages, *page), dtype=dtype)
        return list(pool[:, 0]), list(pool[:, 1])
    pool = torch.zeros((num_pages, num_layers, 2, *page), dtype=dtype)
    return [pool[:, i, 0] for i in range(num_layers)], [pool[:, i, 1] for i in range(num_layers)]


class PagePicker:
    """The decode engine's own page allocator, reduced to a counter for the example."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages, self._next = num_pages, 0

    def take(self, count: int) -> list[int]:
        pages = [(self._next + i) % self.num_pages for i in range(count)]
        self._next += count
        return pages


def serve_one(
    receiver: KVReceiver, router: BlockingRouterClient, picker: PagePicker, room: int,
    prompt: list[int], aux_slot: int, use_asyncio: bool,
) -> bool:  # fmt: skip
    layout = receiver.regions.layout
    pages = picker.take(num_want_pages(len(prompt), 0, layout.page_size))
    receiver.want(room, pages, aux_slot, num_cached_tokens=0)
    # The router sends the prompt naming the room (and this decode, so no other may claim it).
    result = router.prefill(prompt, bootstrap_room=room, decode_peer=receiver.agent_name)
    if use_asyncio:
        status = asyncio.run(receiver.wait_async(room, timeout_s=30.0))
    else:
        status = receiver.wait(room, timeout_s=30.0)
    is_done = status.state is RoomState.DONE
    first_token = receiver.read_aux(aux_slot).first_token_id if is_done else None
    print(
        f"room {room}: {status.state.value} first_token={first_token} "
        f"(router: {result.status.value} {result.first_token_id}) pages={len(pages)}"
    )
    receiver.forget(room)  # the pages hold the prompt's KV: decode from them now
    return is_done and first_token == result.first_token_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True, help="the worker's transfer.bootstrap_bind")
    parser.add_argument("--ingress", required=True, help="the worker's ingress.bind")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--asyncio", action="store_true", help="await wait_async instead")
    args = parser.parse_args(argv)

    layout = describe_worker(args.bootstrap, timeout_s=30.0)  # 1. the worker's layout
    print(f"worker pool: {layout.kind}, {layout.num_layers} layers, page size {layout.page_size}")
    num_pages = 256  # the decode's own budget; only the shape has to match
    k_caches, v_caches = allocate_pool(layout, num_pages)
    receiver = KVReceiver.from_tensors(  # 2. register it
        k_caches, v_caches, args.bootstrap,
        num_aux_rows=16, pool_layout=layout.kind, io_thread=True,
    )  # fmt: skip
    receiver.wait_registered(timeout_s=30.0)
    picker, rng = PagePicker(num_pages), random.Random(0)
    is_ok = True
    with BlockingRouterClient(args.ingress) as router:
        for i in range(args.prompts):  # 3. per request
            prompt = [rng.randrange(1, 200) for _ in range(rng.randrange(5, 60))]
            room = rng.randrange(1, 2**63)
            is_ok &= serve_one(receiver, router, picker, room, prompt, i % 16, args.asyncio)
    receiver.close()
    return 0 if is_ok else 1


if __name__ == "__main__":
    sys.exit(main())
