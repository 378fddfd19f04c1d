"""Byte for byte: this worker's SGLang backend (in this process, over a pool of random bytes)
pushes into SGLang's own decode (``NixlKVReceiver`` over a real ``MHATokenToKVPool`` and
``MetadataBuffers``), for page sizes 1 and 16, fp32 and bf16, a layer-major and a page-major
worker pool (SGLang's is layer-major either way), prompts sent in chunks, with and
without a decode-held prefix. Every prompt page lands in the decode page it asked for, nothing
else in its pool moves, the metadata row holds the first token, the prefix-cache count, the
logprob and the room, and SGLang's receiver says Success. Afterwards every page, aux row, sender and
NIXL handle of the worker is back."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefill_worker.kv.layout import LAYER_MAJOR, PAGE_MAJOR, KVLayout, KVRegions
from prefill_worker.testing.json_child import DecodeError
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.poster import WritePoster
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.options import Hooks
from tests.interop.decodes import SglangDecode
from tests.interop.rig import PrefillRig, push

pytestmark = pytest.mark.interop

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 16
WORKER_PAGES = 64


class InProcessWorker(PrefillRig):
    """The rig over an MHA pool: K of layer l is region l, V region n + l, in the layout's
    order (layer-major or page-major)."""

    def __init__(
        self,
        layout: KVLayout,
        num_aux_rows: int = 8,
        poster_factory: Callable[[Any], WritePoster] | None = None,
        write_timeout_s: float = 5.0,
    ) -> None:
        hooks = Hooks(poster_factory=poster_factory)
        super().__init__(layout, 3, "prefill-interop", num_aux_rows, write_timeout_s, hooks)

    def regions(self) -> KVRegions:
        base, n = int(self.pool.ctypes.data), self.layout.num_layers
        # Where K (region l) and V (region n + l) of layer l start: page p is a page stride on.
        starts = [base + self._offset(region, 0) for region in range(2 * n)]
        return KVRegions(
            self.layout,
            tuple(starts[:n]),
            tuple(starts[n:]),
            "cpu",
            self.aux.base_addr,
            self.aux.num_rows,
        )

    def _offset(self, region: int, page: int) -> int:
        """Byte offset of page ``page`` of layer-region ``region`` (K of layer r < L, V of
        layer r - L) in the pool, in either layout."""
        lay, n = self.layout, self.layout.num_layers
        if lay.kind == LAYER_MAJOR:
            return region * lay.num_pages * lay.page_bytes + page * lay.page_bytes
        slot = 2 * region if region < n else 2 * (region - n) + 1  # K0 V0 K1 V1 ... per page
        return page * lay.page_stride_bytes + slot * lay.page_bytes

    def page(self, region: int, page: int) -> np.ndarray:
        start = self._offset(region, page)
        return self.pool[start : start + self.layout.page_bytes]


@pytest.fixture
def worker_factory() -> Iterator[Callable[..., InProcessWorker]]:
    made: list[InProcessWorker] = []

    def factory(layout: KVLayout, **kwargs: Any) -> InProcessWorker:
        made.append(InProcessWorker(layout, **kwargs))
        return made[-1]

    yield factory
    for worker in made:
        worker.backend.close()


@pytest.mark.parametrize(
    ("dtype", "page_size", "kind"),
    [
        ("float32", 1, LAYER_MAJOR),
        ("float32", 16, LAYER_MAJOR),
        ("bfloat16", 1, LAYER_MAJOR),
        ("bfloat16", 16, LAYER_MAJOR),
        ("float32", 1, PAGE_MAJOR),
        ("bfloat16", 16, PAGE_MAJOR),
    ],
)
def test_every_byte_lands_where_the_decode_asked(
    decode_process: SglangDecodeProcess,
    worker_factory,
    tmp_path: Path,
    dtype: str,
    page_size: int,
    kind: str,
) -> None:
    layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype, page_size, WORKER_PAGES, kind)
    worker = worker_factory(layout)
    decode_layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype, page_size, 48)
    decode = SglangDecode(decode_process, worker.bootstrap, decode_layout)
    cases = [  # (prompt pages, pages the decode holds, pages per chunk)
        (5, 0, 2),
        (7, 3, 3),  # a decode-held prefix: its pages must not be written
        (3, 0, 3),  # one chunk
    ]
    rng = np.random.default_rng(11)
    for num_pages, num_held, chunk_pages in cases:
        room = int(rng.integers(1, 2**63))
        num_tokens = num_pages * page_size - (page_size // 2)  # a partial last page
        decode.want(room, num_tokens, num_held * page_size)
        aux, src = push(worker, room, num_tokens, chunk_pages)
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        for layer in range(NUM_LAYERS):
            for i in range(num_pages):
                for kind, got in (("k", landed.k[layer][i]), ("v", landed.v[layer][i])):
                    region = layer if kind == "k" else NUM_LAYERS + layer
                    if i < num_held:
                        assert (got == FILL_BYTE).all(), f"held page {i} written ({kind}{layer})"
                    else:
                        want = worker.page(region, src[i])
                        assert np.array_equal(got, want), f"page {i} ({kind}{layer}, {dtype})"
        assert landed.output_ids[0] == aux.first_token_id
        assert landed.cached_tokens[0] == num_tokens - aux.num_computed_tokens
        assert landed.logprob_val[0] == np.float32(-0.25)
        assert landed.logprob_idx[0] == aux.first_token_id
        assert int(landed.bootstrap_room[0]) == room
    worker.check_whole()


def test_a_decode_the_worker_cannot_serve_learns_why(
    decode_process: SglangDecodeProcess, worker_factory
) -> None:
    """A pool of another head size is refused at registration; SGLang's receiver fails the
    room with the worker's reason. A page size that differs SGLang's decode refuses itself,
    from ``/route``."""
    layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float32", 16, WORKER_PAGES)
    worker = worker_factory(layout)
    narrow = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM // 2, "float32", 16, 48)
    decode = SglangDecode(decode_process, worker.bootstrap, narrow)
    room = int(np.random.default_rng(5).integers(1, 2**63))
    decode.want(room, 40)
    assert worker.drive(lambda: decode.state(room)[0] == "Failed")
    reason = str(decode.state(room)[1])
    assert "registration refused" in reason and "layout differ" in reason, reason
    assert worker.backend.reject_counts == {"layout_mismatch": 1, "unknown_peer": 1}
    other_page = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float32", 4, 48)
    mismatched = SglangDecode(decode_process, worker.bootstrap, other_page)
    with pytest.raises(DecodeError, match="Page size mismatch"):
        mismatched.want(room + 1, 40)
    worker.check_whole()


class GatedAgent:
    """The real agent, except that ``transfer()`` (the copy, on the transfer thread) waits
    for ``gate``."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.gate = threading.Event()
        self.entered = threading.Event()

    def make_prepped_xfer(self, *args: Any) -> Any:
        return self._agent.make_prepped_xfer(*args)

    def transfer(self, handle: Any) -> str:
        self.entered.set()
        self.gate.wait(60)  # bounded: a broken test must not hang the suite
        return str(self._agent.transfer(handle))

    def check_xfer_state(self, handle: Any) -> str:
        return str(self._agent.check_xfer_state(handle))


def test_a_failure_reaches_the_decode_only_once_no_write_can_land(
    decode_process: SglangDecodeProcess, worker_factory
) -> None:
    """A request fails while its first chunk's copy is held on the transfer thread: the
    decode must not hear KV_STATUS failed (it would reuse the pages) until the copy is over.
    A second room failed later, with no write, is heard first (replies to one decode go out
    in order, so this is the proof that the first was held); then the copy goes, and so does
    the first room's failure. The pools are whole afterwards."""
    gated: list[GatedAgent] = []

    def poster(agent: Any) -> PushThread:
        gated.append(GatedAgent(agent))
        return PushThread(gated[-1], "nixl-push-gated")

    layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float32", 16, WORKER_PAGES)
    worker = worker_factory(layout, poster_factory=poster, write_timeout_s=60.0)
    decode_layout = KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float32", 16, 48)
    decode = SglangDecode(decode_process, worker.bootstrap, decode_layout)
    held_room, free_room = (int(r) for r in np.random.default_rng(8).integers(1, 2**63, 2))
    decode.want(held_room, 40)
    decode.want(free_room, 40)
    held = worker.backend.create_sender(held_room, "held", 40)
    free = worker.backend.create_sender(free_room, "free", 40)
    assert worker.drive(lambda: held.poll() is KVPoll.READY and free.poll() is KVPoll.READY)
    src = worker.pages.try_alloc(3)
    assert src is not None
    held.send_pages(src, 0)
    assert gated[0].entered.wait(30), "the copy never started"
    held.fail("the engine gave up on it")
    held.close()
    worker.backend.poll()  # the failure is held: a write is in flight
    free.fail("the second one fails too")
    free.close()
    assert worker.drive(lambda: decode.state(free_room)[0] == "Failed")
    assert decode.state(held_room)[0] != "Failed", "failed went out while a copy was held"
    gated[0].gate.set()
    assert worker.drive(lambda: decode.state(held_room)[0] == "Failed")
    assert "the engine gave up on it" in str(decode.state(held_room)[1])
    worker.pages.free(src)
    assert worker.drive(lambda: worker.backend.num_inflight_transfers() == 0)
    worker.check_whole()
