"""A DeepSeek-V3.2 checkpoint (MLA + the DSA indexer) in the real daemon with a native decode
(the decode SDK, real NIXL): the worker publishes its MLA pool as the KV layout and its index
keys as a paged state component (``index_keys``: per indexed layer, one page of keys per KV
page, ``describe_state``); a decode that registers an index pool beside its MLA pool receives,
per room, every layer's latent rows in its pages and every indexed layer's index keys in the
same pages of its index pool, equal to transformers' within 1e-4: three prompts at once
(batched), each longer than a chunk (chunked) and than the indexer's top-k (12), into
scattered pages, then a prompt whose first 32 tokens the worker's prefix cache serves (the
index keys are in the pages, so a hit is a real one). A decode without an index pool is
refused with a typed reason (``state_unsupported``) and gets no byte. Afterwards every page
and aux row is back and the worker drains to exit 0."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.state_layout import PAGES, StateComponent
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import (
    KVReceiver,
    RoomState,
    describe_state,
    describe_worker,
    state_regions_from_tensors,
)
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import (
    DECODE_PAGES,
    PAGE_SIZE,
    Decode,
    decode_pool,
    prefill_claimed,
    start_worker,
    wait_until,
)
from tests.integration.daemon.test_hybrid_daemon import pools_whole, refuse_a_decode_without_state
from tests.integration.model.conftest import hf_index_keys, hf_mla_forward
from tests.patience import patient

TOL = 1e-4
PROMPTS = {6301: 37, 6302: 50, 6303: 23}  # room: prompt tokens (chunks are 16, top-k 12)


class IndexDecode(Decode):
    """A decode with an MLA pool and an index pool of the worker's component: per indexed
    layer ``[DECODE_PAGES, page_size, index_head_dim]``, zeros. ``tp``: this receiver is
    rank ``tp[0]`` of a decode of TP ``tp[1]`` (each rank holds the whole latent and index
    keys); ``io_thread``: the receiver's own I/O thread answers the worker."""

    def __init__(
        self, bootstrap: str, tp: tuple[int, int] | None = None, io_thread: bool = False
    ) -> None:
        layout = describe_worker(bootstrap, 30.0)
        (component,) = describe_state(bootstrap, 30.0)
        self.component: StateComponent = component
        self.k, self.v = decode_pool(
            layout.kind, layout.num_kv_heads, layout.head_dim, layout.num_layers
        )
        (tensor,) = component.tensors
        dtype = getattr(torch, tensor.dtype)
        self.index = [
            torch.zeros((DECODE_PAGES, *tensor.item_shape), dtype=dtype)
            for _ in component.layer_ids
        ]
        regions = state_regions_from_tensors(component, [self.index])
        rank = None if tp is None else (*tp, 1)
        self.receiver = KVReceiver.from_tensors(
            self.k, self.v, bootstrap, num_aux_rows=8, state=regions, tp=rank, io_thread=io_thread
        )
        self.receiver.wait_registered(timeout_s=patient(30))
        self._next_page, self._next_slot, self.rooms = DECODE_PAGES - 1, 0, {}

    def latent_rows(self, room: int, num_tokens: int, layer: int) -> torch.Tensor:
        pages, _ = self.rooms[room]
        return torch.cat([self.k[layer][p] for p in pages])[:num_tokens, 0]

    def index_keys(self, room: int, num_tokens: int, slot_layer: int) -> torch.Tensor:
        pages, _ = self.rooms[room]
        return torch.cat([self.index[slot_layer][p] for p in pages])[:num_tokens]


def check_landed(decode: IndexDecode, model: torch.nn.Module, room: int, ids: list[int]) -> None:
    """Every layer's latent rows and every indexed layer's index keys, as transformers has them."""
    _, rows = hf_mla_forward(model, ids)
    for layer, expected in enumerate(rows):
        landed = decode.latent_rows(room, len(ids), layer)
        torch.testing.assert_close(landed, expected, atol=TOL, rtol=0)
    for slot_layer, expected in enumerate(hf_index_keys(model, ids).values()):
        landed = decode.index_keys(room, len(ids), slot_layer)
        torch.testing.assert_close(landed, expected, atol=TOL, rtol=0)


def serve_a_prefix_hit(
    router: BlockingRouterClient, decode: IndexDecode, model: torch.nn.Module, prefix: list[int]
) -> None:
    """A prompt sharing a finished one's first 32 tokens: the worker's prefix cache serves
    them (their latent rows and index keys read from its pages, not computed), and what lands
    is still transformers' whole prompt."""
    ids, room = prefix + prompt(13, seed=6304), 6304
    decode.want(room, len(ids))
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(router.prefill, ids, room, timeout_s=60)
        assert decode.wait([room])[room].state is RoomState.DONE
        result = sent.result(60)
    assert result.status is OutcomeStatus.OK, result
    assert (result.num_prefix_hit_tokens, result.num_computed_tokens) == (32, 13)
    check_landed(decode, model, room, ids)


def test_a_native_decode_receives_the_mla_rows_and_the_index_keys(tmp_path: Path) -> None:
    checkpoint = make_checkpoint("deepseek_v32", tmp_path / "dsv32")
    settings = ("cache.num_pages=64", "cache.num_aux_rows=4", "cache.prefix_caching=true")
    worker = start_worker(tmp_path, checkpoint, *settings)
    try:
        worker.child.wait_ready(120)
        router = BlockingRouterClient(worker.ingress)
        decode = IndexDecode(worker.bootstrap)
        component = decode.component
        kind = (component.kind, component.copy, component.layer_ids)
        assert kind == ("index_keys", PAGES, (0, 1, 2))
        assert component.tensors[0].item_shape == (PAGE_SIZE, 24)
        prompts = {room: prompt(n, seed=room) for room, n in PROMPTS.items()}
        statuses, results = prefill_claimed(router, decode, prompts)
        model = hf_model(checkpoint)
        for room, ids in prompts.items():
            assert results[room].status is OutcomeStatus.OK, results[room]
            assert statuses[room].state is RoomState.DONE, statuses[room]
            check_landed(decode, model, room, ids)
        serve_a_prefix_hit(router, decode, model, prompts[6302][:32])
        used = {p for pages, _ in decode.rooms.values() for p in pages}
        unused = sorted(set(range(DECODE_PAGES)) - used)
        assert all(not torch.any(t[unused]) for t in decode.index)  # only the rooms' pages
        decode.close()
        refuse_a_decode_without_state(worker, router)
        router.close()
        wait_until(lambda: pools_whole(worker), 30, "every aux row and page back")
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()
