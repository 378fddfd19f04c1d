"""``model.draft: eagle3`` served by a TP-2 worker over the native protocol: the real daemon
(two rank processes, gloo on CPU, fp32) on a tiny random Llama (2 KV heads: one per rank) and
its tiny random EAGLE-3 draft (``tests/eagle_checkpoints.py``, the target's K/V geometry), and
native decodes (``KVReceiver``, real NIXL) that register a draft pool and draft rows beside
their target pool. Each worker rank writes its draft heads beside its target heads; the aux
row and the draft row (top-k probabilities, top-k ids, hidden state) come from the leader:

- a decode of TP 1 (both heads in each token: each worker rank writes token runs of its
  head, the leader into its first half, the follower into its second): the draft pool's K and
  V, the top-k and the hidden state equal the reference written from the draft's definition
  (``test_eagle_draft.reference``) within 1e-4, the first token is transformers';
- a decode of TP 2 (a receiver per rank, one head each: whole pages from its own worker
  rank): every rank DONE, its draft row the TP-1 decode's; the target and draft pools,
  joined head by head (``gather_kv_heads``), byte for byte what the TP-1 decode received;
- the worker's page and aux pools are whole afterwards, and SIGTERM drains every rank to
  exit 0.

One worker for the module; both decodes get the same prompt, its prompt logprobs asked from
0 so that no prefix-cache hit changes how the second room is computed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import KVRegions
from prefill_worker.model.parallel import gather_kv_heads
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker
from prefill_worker.transfer.draft import DraftSide
from tests.checkpoints import hf_model, prompt
from tests.eagle_checkpoints import HEAD_DIM, HIDDEN, KV_HEADS, target_and_draft
from tests.integration.daemon.conftest import (
    DECODE_PAGES,
    PAGE_SIZE,
    Worker,
    decode_pool,
    start_worker,
    wait_ready,
)
from tests.integration.daemon.test_hybrid_daemon import pools_whole
from tests.integration.model import test_eagle_draft
from tests.patience import patient
from tests.polling import wait_until

PROMPT = prompt(23, seed=4501)  # two chunks of 16 (configs/tiny-test.yaml), 6 pages
ROOM_D1, ROOM_D2 = 4501, 4502
NUM_AUX_ROWS, SLOT = 4, 1
Planes = list[torch.Tensor]  # [target K per layer, target V per layer, draft K, draft V]


class DraftRank:
    """One rank of a native decode of TP ``tp_size`` that speculates: its target pool and a
    one-layer draft pool of its heads, its draft rows, a receiver, its own scattered pages."""

    def __init__(self, bootstrap: str, rank: int, tp_size: int) -> None:
        layout = describe_worker(bootstrap, 30.0)
        num_heads = len(kv_head_range(KV_HEADS, rank, tp_size))
        self.k, self.v = decode_pool(layout.kind, num_heads, HEAD_DIM, layout.num_layers)
        (self.draft_k,), (self.draft_v,) = decode_pool(layout.kind, num_heads, HEAD_DIM, 1)
        self.rows = DraftRows(NUM_AUX_ROWS, HIDDEN * 4)  # float32
        one = dataclasses.replace(
            layout, num_layers=1, num_kv_heads=num_heads, num_pages=DECODE_PAGES
        )
        ptrs = (self.draft_k.data_ptr(),), (self.draft_v.data_ptr(),)
        regions = KVRegions(one, *ptrs, "cpu", self.rows.base_addr, NUM_AUX_ROWS)
        self.receiver = KVReceiver.from_tensors(
            self.k, self.v, bootstrap, num_aux_rows=NUM_AUX_ROWS, io_thread=True,
            tp=None if tp_size == 1 else (rank, tp_size, KV_HEADS),
            draft=DraftSide(regions, self.rows),
        )  # fmt: skip
        self.pages = [DECODE_PAGES - 1 - 3 * i - rank for i in range(-(-len(PROMPT) // PAGE_SIZE))]

    def planes(self) -> Planes:
        """What landed, each ``[tokens, local heads, D]``."""
        pools = [*self.k, *self.v, self.draft_k, self.draft_v]
        return [torch.cat([pool[p] for p in self.pages])[: len(PROMPT)] for pool in pools]


class DraftDecode:
    """A decode of TP ``tp_size``: a ``DraftRank`` per rank."""

    def __init__(self, bootstrap: str, tp_size: int) -> None:
        self.ranks: list[DraftRank] = []
        try:
            for rank in range(tp_size):
                self.ranks.append(DraftRank(bootstrap, rank, tp_size))
                self.ranks[-1].receiver.wait_registered(timeout_s=patient(30))
        except BaseException:
            self.close()
            raise

    def receive(self, router: BlockingRouterClient, room: int) -> int:
        """PROMPT into ``room`` on every rank: the first token."""
        for rank in self.ranks:
            rank.receiver.want(room, rank.pages, SLOT, 0)
        result = router.prefill(PROMPT, room, return_logprob=True, logprob_start_len=0)
        assert result.status is OutcomeStatus.OK, result
        receivers = [rank.receiver for rank in self.ranks]

        def settled() -> bool:
            return all(r.poll(room).state is not RoomState.PENDING for r in receivers)

        wait_until(settled, 60.0, f"room {room} on every decode rank")
        for receiver in receivers:
            assert receiver.poll(room).state is RoomState.DONE, receiver.poll(room)
            assert receiver.read_aux(SLOT).first_token_id == result.first_token_id
        return result.first_token_id

    def planes(self) -> Planes:
        """The planes, every head: the ranks' joined by the head rule."""
        per_rank = [rank.planes() for rank in self.ranks]
        return [gather_kv_heads(list(plane), KV_HEADS) for plane in zip(*per_rank, strict=True)]

    def close(self) -> None:
        for rank in self.ranks:
            rank.receiver.close()


@dataclass
class Served:
    worker: Worker  # still serving: SIGTERM drains it at the module's end
    root: Path
    d1: DraftDecode  # closed; its pools and rows stay readable
    d2: DraftDecode
    first_token_ids: tuple[int, int]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("draft-tp")
    target, draft = target_and_draft(root, "eagle3")
    settings = (
        "parallel.tp_size=2",
        "model.draft=eagle3",
        f"model.draft_path={draft}",
        f"model.draft_topk={test_eagle_draft.TOPK}",
        "cache.num_pages=64",
    )
    worker = start_worker(root, target, *settings)
    try:
        wait_ready(worker)
        router = BlockingRouterClient(worker.ingress)
        decodes: list[DraftDecode] = []
        try:
            decodes = [DraftDecode(worker.bootstrap, size) for size in (1, 2)]
            firsts = (decodes[0].receive(router, ROOM_D1), decodes[1].receive(router, ROOM_D2))
        finally:
            for decode in decodes:
                decode.close()
            router.close()
        yield Served(worker, root, decodes[0], decodes[1], firsts)
        assert worker.child.stop() == 0, worker.log()  # SIGTERM drains every rank
    finally:
        worker.child.kill()


def test_a_tp1_decode_gets_the_references_draft_from_both_ranks(served: Served) -> None:
    tensors = load_file(served.root / "eagle3" / "model.safetensors")
    first, topk_p, topk_index, hidden, ref_k, ref_v = test_eagle_draft.reference(
        "eagle3", hf_model(served.root / "target"), tensors, PROMPT
    )
    assert served.first_token_ids == (first, first)
    *_, draft_k, draft_v = served.d1.planes()
    torch.testing.assert_close(draft_k, ref_k, atol=1e-4, rtol=0)  # both heads: both ranks'
    torch.testing.assert_close(draft_v, ref_v, atol=1e-4, rtol=0)
    row = served.d1.ranks[0].rows.read(SLOT)
    assert row is not None and list(row.topk_index) == topk_index.tolist()
    torch.testing.assert_close(torch.tensor(row.topk_p), topk_p, atol=1e-4, rtol=0)
    got_hidden = torch.frombuffer(bytearray(row.hidden), dtype=torch.float32)
    torch.testing.assert_close(got_hidden, hidden, atol=1e-4, rtol=0)


def test_a_tp2_decode_gets_the_tp1_decodes_bytes_head_by_head(served: Served) -> None:
    reference = served.d1.planes()
    for plane, (got, want) in enumerate(zip(served.d2.planes(), reference, strict=True)):
        assert torch.equal(got, want), plane
    assert all(plane.abs().sum() > 0 for plane in reference)  # every plane landed
    row = served.d1.ranks[0].rows.read(SLOT)
    for rank in served.d2.ranks:
        assert rank.rows.read(SLOT) == row


def test_the_pools_are_whole_afterwards(served: Served) -> None:
    wait_until(lambda: pools_whole(served.worker), 10.0, "every aux row and page back")
