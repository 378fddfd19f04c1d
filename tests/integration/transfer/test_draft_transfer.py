"""A draft's KV and first proposal on the native protocol over real NIXL (CPU memory over
UCX): a worker with a one-layer MLA draft pool and draft rows beside its MLA pool
(``native.draft``) writes, into a decode SDK that registered a draft pool and rows of its own
(``KVReceiver(draft=...)``, ``wire.DraftPool``), every target and draft page byte for byte
(a held page untouched) and the room's draft row with its aux row (``read_draft``); a decode
without a draft pool is served the target alone; a decode whose draft is not the worker's
is refused naming both. Pools whole after."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from prefill_worker.batch import DraftRow
from prefill_worker.kv.aux import AuxRow
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import MLA, KVLayout, KVRegions
from prefill_worker.transfer import KVReceiver, RoomState
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.decode.receiver import RegistrationError
from prefill_worker.transfer.draft import DraftSide
from tests.integration.transfer.conftest import Worker
from tests.integration.transfer.peers import PoolSpec, layer_page, regions_over

NUM_PAGES, PAGE, LATENT, HIDDEN_BYTES, NUM_ROWS = 24, 16, 24, 40, 8
LAYOUT = KVLayout(2, 1, LATENT, "bfloat16", PAGE, NUM_PAGES, MLA)
DRAFT = DraftRow((0.625, 0.25), (300, 7), bytes(range(100, 140)))


@pytest.fixture(scope="module")
def pool_layout() -> str:
    """This module is about the MLA pool DeepSeek-V3's MTP draft rides beside."""
    return MLA


def draft_side(pool: np.ndarray, rows: DraftRows, num_layers: int = 1) -> DraftSide:
    """A draft pool of ``num_layers`` latents at the start of ``pool``."""
    lay = dataclasses.replace(LAYOUT, num_layers=num_layers)
    base = int(pool.ctypes.data)
    k = tuple(base + i * lay.region_bytes for i in range(num_layers))
    return DraftSide(KVRegions(lay, k, (), "cpu", rows.base_addr, rows.num_rows), rows)


@pytest.fixture
def worker() -> Iterator[Worker]:
    pool = np.random.default_rng(9).integers(0, 256, LAYOUT.region_bytes, dtype=np.uint8)
    rows = DraftRows(NUM_ROWS, HIDDEN_BYTES)
    worker = Worker(PoolSpec(LAYOUT, NUM_ROWS), draft=draft_side(pool, rows))
    worker.draft_pool, worker.draft_rows = pool, rows  # type: ignore[attr-defined]
    yield worker
    worker.backend.close()


class Decode:
    """A receiver in this process over byte pools (0xAB everywhere), with a draft of
    ``num_draft_layers`` (0: none)."""

    def __init__(self, worker: Worker, num_draft_layers: int, hidden_bytes: int = HIDDEN_BYTES):
        spec = PoolSpec(LAYOUT, NUM_ROWS)
        self.pool = np.full(spec.nbytes, 0xAB, np.uint8)
        self.draft_pool = np.full(LAYOUT.region_bytes * max(1, num_draft_layers), 0xAB, np.uint8)
        self.rows = DraftRows(NUM_ROWS, hidden_bytes)
        draft = draft_side(self.draft_pool, self.rows, num_draft_layers)
        endpoint = worker.backend.bootstrap_endpoint
        self.receiver = KVReceiver(
            regions_over(spec, self.pool), endpoint, io_thread=True,
            draft=draft if num_draft_layers else None,
        )  # fmt: skip

    def registered(self, worker: Worker) -> BaseException | None:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(self.receiver.wait_registered, 10.0)
            assert worker.drive(future.done, 15.0), "no answer to register"
            return future.exception()


def push(worker: Worker, decode: Decode, room: int, dst: list[int]) -> list[int]:
    """One request of 5 pages (the last partial), its first page held by the decode, in
    chunks of two pages; its draft row into its aux row. The worker pages that held it."""
    num_tokens = 5 * PAGE - 3
    decode.receiver.want(room, dst, 3, PAGE)
    sender = worker.backend.create_sender(room, f"req-{room}", num_tokens)
    assert worker.drive(lambda: sender.poll() is KVPoll.READY), sender.failure_reason()
    src = worker.alloc(5)
    for first in range(0, 5, 2):
        sender.send_pages(src[first : first + 2], first)
    row = worker.aux.try_alloc()
    assert row is not None
    worker.draft_rows.write(row, DRAFT)  # type: ignore[attr-defined]
    worker.aux.write(row, AuxRow(77, -0.5, num_tokens, PAGE))
    sender.send_aux(row)
    assert worker.drive(lambda: sender.poll().is_terminal)
    assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()
    assert decode.receiver.wait(room, 5.0).state is RoomState.DONE
    sender.close()
    worker.aux.free(row)
    worker.pages.free(src)
    return src


def test_the_draft_pages_and_row_land_in_a_decode_with_a_draft(worker: Worker) -> None:
    decode = Decode(worker, 1)
    try:
        assert decode.registered(worker) is None
        dst = [20, 3, 17, 9]  # the 4 pages after the held one
        src = push(worker, decode, 41, dst)
        moved = dict(zip(dst, src[1:], strict=True))
        one = dataclasses.replace(LAYOUT, num_layers=1)
        draft_pool: np.ndarray = worker.draft_pool  # type: ignore[attr-defined]
        pools = [(decode.pool, worker.pool, LAYOUT, 0), (decode.pool, worker.pool, LAYOUT, 1),
                 (decode.draft_pool, draft_pool, one, 0)]  # fmt: skip
        for page in range(NUM_PAGES):
            for theirs, ours, lay, layer in pools:
                got = layer_page(theirs, lay, layer, 0, page)
                want = layer_page(ours, lay, layer, 0, moved[page]) if page in moved else 0xAB
                assert np.array_equal(got, np.broadcast_to(want, got.shape)), (layer, page)
        assert decode.receiver.read_draft(3) == DRAFT
        assert decode.receiver.read_draft(2) is None
        assert decode.receiver.read_aux(3).first_token_id == 77
    finally:
        decode.receiver.close()
    worker.check_whole()


def test_a_decode_without_a_draft_gets_the_target_and_a_mismatched_one_is_refused(
    worker: Worker,
) -> None:
    plain = Decode(worker, 0)
    try:
        assert plain.registered(worker) is None
        src = push(worker, plain, 42, [5, 6, 7, 8])
        got = layer_page(plain.pool, LAYOUT, 1, 0, 5)
        assert np.array_equal(got, layer_page(worker.pool, LAYOUT, 1, 0, src[1]))
        assert (plain.draft_pool == 0xAB).all() and plain.receiver.read_draft(3) is None
    finally:
        plain.receiver.close()
    for layers, hidden, words in [(2, HIDDEN_BYTES, "2 layers and rows of 236"),
                                  (1, 8, "1 layers and rows of 204")]:  # fmt: skip
        other = Decode(worker, layers, hidden)
        try:
            refusal = other.registered(worker)
            assert isinstance(refusal, RegistrationError), refusal
            assert "draft mismatch" in str(refusal) and words in str(refusal), str(refusal)
            assert "this worker's draft has 1 layers and rows of 236 bytes" in str(refusal)
        finally:
            other.receiver.close()
    worker.check_whole()
