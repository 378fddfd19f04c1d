"""An MLA pool (``kv.layout`` kind ``mla``: one latent per token and layer, no V) over real NIXL
(CPU memory over UCX): the native backend (``make_backend``) writes a pool of known bytes into
a decode SDK's latent tensors (``KVReceiver.from_tensors``), byte for byte, page sizes 1 and
16, and into each rank of a decode of TP 2 (every rank the whole latent); ``describe`` names
the MLA shape; a decode whose pool kind or latent width differs is
refused with a reason naming both."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from prefill_worker.kv.aux import AuxRow
from prefill_worker.kv.layout import MLA, KVLayout
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.decode.receiver import RegistrationError
from tests.integration.transfer.conftest import Worker
from tests.integration.transfer.peers import PoolSpec, layer_page, regions_over

NUM_LAYERS, LATENT = 2, 24  # the latent: kv_lora_rank 16 + qk_rope_head_dim 8
NUM_PAGES = 24


@pytest.fixture(scope="module")
def pool_layout() -> str:
    """This module is about one kind (the package's fixture runs the others)."""
    return MLA


def mla_spec(page_size: int, latent: int = LATENT) -> PoolSpec:
    return PoolSpec(
        KVLayout(NUM_LAYERS, 1, latent, "bfloat16", page_size, NUM_PAGES, MLA), num_aux_rows=8
    )


@pytest.fixture
def mla_worker(request: pytest.FixtureRequest) -> Iterator[Worker]:
    worker = Worker(mla_spec(request.param))
    yield worker
    worker.backend.close()


def latent_tensors(page_size: int) -> list[torch.Tensor]:
    """A decode's pool: per layer [num_pages, page_size, 1, latent] bf16 of random bytes."""
    gen = torch.Generator().manual_seed(5)
    shape = (NUM_PAGES, page_size, 1, 2 * LATENT)  # bytes: 2 per bf16
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.bfloat16)
        for _ in range(NUM_LAYERS)
    ]


def registered(worker: Worker, receiver: KVReceiver) -> BaseException | None:
    """Drive the worker until the receiver hears its answer; the refusal, or None."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(receiver.wait_registered, 10.0)
        assert worker.drive(future.done, 15.0), "no answer to register"
        return future.exception()


def push(worker: Worker, receiver: KVReceiver, room: int, num_tokens: int, dst: list[int]):
    """One request, one decode-held page first: (the worker pages that held it, its aux)."""
    lay = worker.spec.layout
    receiver.want(room, dst, 3, lay.page_size)
    sender = worker.backend.create_sender(room, f"req-{room}", num_tokens)
    assert worker.drive(lambda: sender.poll() is KVPoll.READY), sender.failure_reason()
    src = worker.alloc(-(-num_tokens // lay.page_size))
    for first in range(0, len(src), 2):  # chunks of two pages
        sender.send_pages(src[first : first + 2], first)
    aux = AuxRow(77, -0.5, num_tokens, lay.page_size)
    row = worker.finish(sender, aux)
    assert receiver.wait(room, 5.0).state is RoomState.DONE
    sender.close()
    worker.aux.free(row)
    return src, aux


def assert_landed(
    worker: Worker,
    lay: KVLayout,
    latents: list[torch.Tensor],
    before: list[torch.Tensor],
    moved: dict[int, int],
) -> None:
    """Each decode page in ``moved`` holds the worker's page it maps to, in every layer,
    byte for byte; every other page is as it was ``before``."""
    for layer in range(NUM_LAYERS):
        got = latents[layer].view(torch.uint8).view(NUM_PAGES, -1).numpy()
        was = before[layer].view(torch.uint8).view(NUM_PAGES, -1).numpy()
        for page in range(NUM_PAGES):
            want = was[page]
            if page in moved:
                want = layer_page(worker.pool, lay, layer, 0, moved[page])
            assert np.array_equal(got[page], want), (layer, page)


@pytest.mark.parametrize("mla_worker", [1, 16], indirect=True, ids=["page1", "page16"])
def test_the_decode_sdk_receives_an_mla_pool_byte_for_byte(mla_worker: Worker) -> None:
    worker, lay = mla_worker, mla_worker.spec.layout
    endpoint = worker.backend.bootstrap_endpoint
    with ThreadPoolExecutor(1) as pool:
        described = pool.submit(describe_worker, endpoint, 10.0)
        assert worker.drive(described.done, 10.0)
    assert described.result() == lay
    latents = latent_tensors(lay.page_size)
    before = [t.clone() for t in latents]
    receiver = KVReceiver.from_tensors(latents, [], endpoint, num_aux_rows=8, io_thread=True)
    try:
        assert receiver.regions.layout == lay and receiver.regions.v_base_addrs == ()
        assert registered(worker, receiver) is None
        num_tokens = 7 * lay.page_size - lay.page_size // 2  # a partial last page
        dst = [20, 3, 17, 4, 9, 11]  # scattered: the 6 pages after the held one
        src, aux = push(worker, receiver, 41, num_tokens, dst)
        assert_landed(worker, lay, latents, before, dict(zip(dst, src[1:], strict=True)))
        assert receiver.read_aux(3) == aux
        worker.pages.free(src)
    finally:
        receiver.close()
    worker.check_whole()


@pytest.mark.parametrize("mla_worker", [16], indirect=True, ids=["page16"])
def test_a_decode_of_another_kind_or_latent_width_is_refused_naming_both(
    mla_worker: Worker,
) -> None:
    worker = mla_worker
    endpoint = worker.backend.bootstrap_endpoint
    ours = "mla (one latent of 24 values per token and layer)"
    cases = [  # (the decode's pool, how the refusal names it)
        (
            KVLayout(NUM_LAYERS, 2, 8, "bfloat16", 16, NUM_PAGES),
            "layer_major (2 KV heads x head_dim 8)",
        ),
        (mla_spec(16, latent=32).layout, "mla (one latent of 32 values per token and layer)"),
    ]
    for layout, theirs in cases:
        spec = PoolSpec(layout, num_aux_rows=8)
        buf = np.zeros(spec.nbytes, np.uint8)
        receiver = KVReceiver(regions_over(spec, buf), endpoint, io_thread=True)
        try:
            refusal = registered(worker, receiver)
        finally:
            receiver.close()
        assert isinstance(refusal, RegistrationError)
        assert str(refusal) == (
            f"KV layout mismatch: the decode pool is {theirs}, this worker's is {ours}; size "
            "the decode pool from the worker's layout (describe, or kv_layout in /readyz)"
        )
    assert worker.backend.reject_counts.get("layout_mismatch") == 2
    worker.check_whole()


def test_the_decode_sdk_refuses_tensors_that_are_not_one_mla_pool() -> None:
    latent = torch.zeros(4, 16, 1, LATENT)
    with pytest.raises(ValueError, match="an mla pool is one latent tensor per layer and no V"):
        KVReceiver.from_tensors([latent], [latent], "tcp://127.0.0.1:1", pool_layout=MLA)
    with pytest.raises(ValueError, match=r"an mla pool has one latent per token \(num_kv_heads 2"):
        KVReceiver.from_tensors([torch.zeros(4, 16, 2, LATENT)], [], "tcp://127.0.0.1:1")


@pytest.mark.parametrize("mla_worker", [4], indirect=True, ids=["page4"])
def test_each_rank_of_a_tp2_decode_receives_the_whole_latent(mla_worker: Worker) -> None:
    """A decode of TP 2 runs a receiver per rank, each over a whole latent pool (the latent is
    one replicated "head": ``tp=(rank, 2, 1)``), each wanting the room with its own pages; the
    worker (TP 1) writes each rank every latent page, the aux row and the status."""
    worker, lay = mla_worker, mla_worker.spec.layout
    endpoint = worker.backend.bootstrap_endpoint
    pools = [latent_tensors(lay.page_size) for _ in range(2)]
    before = [[t.clone() for t in pool] for pool in pools]
    receivers = [
        KVReceiver.from_tensors(pool, [], endpoint, num_aux_rows=8, io_thread=True, tp=(r, 2, 1))
        for r, pool in enumerate(pools)
    ]
    try:
        for receiver in receivers:
            assert registered(worker, receiver) is None
        num_tokens = 5 * lay.page_size - 1
        dst = [[20, 3, 17, 4, 9], [2, 21, 8, 13, 0]]  # each rank its own pages
        for receiver, pages in zip(receivers, dst, strict=True):
            receiver.want(43, pages, 5, 0)
        sender = worker.backend.create_sender(43, "req-43", num_tokens)
        assert worker.drive(lambda: sender.poll() is KVPoll.READY), sender.failure_reason()
        src = worker.alloc(len(dst[0]))
        sender.send_pages(src, 0)
        aux = AuxRow(78, -0.25, num_tokens, 0)
        row = worker.finish(sender, aux)
        for rank, receiver in enumerate(receivers):
            assert receiver.wait(43, 5.0).state is RoomState.DONE, rank
            assert receiver.read_aux(5) == aux
        sender.close()
        worker.aux.free(row)
        for pool, was, pages in zip(pools, before, dst, strict=True):
            assert_landed(worker, lay, pool, was, dict(zip(pages, src, strict=True)))
        worker.pages.free(src)
    finally:
        for receiver in receivers:
            receiver.close()
    worker.check_whole()
