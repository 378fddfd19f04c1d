"""A decode of tensor-parallel size 2, 4 and 8 receiving from the worker (TP 1), over the native
protocol: each decode rank is its own ``KVReceiver`` (own NIXL agent, own pool holding only
its KV heads by ``kv.heads``) wanting the room with its own pages. The ranks' pools,
reassembled head by head (``model.parallel.gather_kv_heads``, which also checks replicas
agree), must equal byte for byte what a TP-1 decode received for the same prompt; every rank
ends DONE with the first token in its aux row. The test model has 2 KV heads: TP 2 slices
(one head per rank, token runs), TP 4 and 8 replicate (two and four ranks per head); at TP 8
the eight wants come before the request, past the old bound of 4 waiting wants per room.

Shares the package's worker (``shared_worker``); one prompt per decode TP size."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.heads import kv_head_range
from prefill_worker.model.parallel import gather_kv_heads
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PAGE_SIZE
from tests.patience import patient
from tests.polling import wait_until

NUM_TOKENS, NUM_PAGES = 23, 32  # 6 pages, the last one partial
PROMPT = prompt(NUM_TOKENS, seed=27)


class DecodeRank:
    """One rank of a decode of TP ``tp_size``: a pool of its heads and a receiver."""

    def __init__(self, bootstrap: str, rank: int, tp_size: int, kind: str) -> None:
        self.heads = kv_head_range(NUM_KV_HEADS, rank, tp_size)
        page = (PAGE_SIZE, len(self.heads), HEAD_DIM)
        if kind == "layer_major":
            pool = torch.zeros((NUM_LAYERS, 2, NUM_PAGES, *page))
            self.k, self.v = list(pool[:, 0]), list(pool[:, 1])
        else:
            pool = torch.zeros((NUM_PAGES, NUM_LAYERS, 2, *page))
            self.k = [pool[:, i, 0] for i in range(NUM_LAYERS)]
            self.v = [pool[:, i, 1] for i in range(NUM_LAYERS)]
        tp = None if tp_size == 1 else (rank, tp_size, NUM_KV_HEADS)
        self.receiver = KVReceiver.from_tensors(
            self.k, self.v, bootstrap, num_aux_rows=4, tp=tp, io_thread=True
        )
        self.receiver.wait_registered(timeout_s=patient(30))
        # Each rank its own scattered pages: a rank written into another's pages shows.
        self.pages = [NUM_PAGES - 1 - 3 * i - rank for i in range(-(-NUM_TOKENS // PAGE_SIZE))]
        self.slot = rank % 4

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[NUM_TOKENS, local heads, D]`` K and V as landed."""
        k = torch.cat([self.k[layer][p] for p in self.pages])[:NUM_TOKENS]
        v = torch.cat([self.v[layer][p] for p in self.pages])[:NUM_TOKENS]
        return k, v


def _receive(worker, router, room: int, tp_size: int) -> list[DecodeRank]:  # type: ignore[no-untyped-def]
    kind = describe_worker(worker.bootstrap, 30.0).kind
    ranks = [DecodeRank(worker.bootstrap, r, tp_size, kind) for r in range(tp_size)]
    try:
        for rank in ranks:
            rank.receiver.want(room, rank.pages, rank.slot, 0)
        # Prompt logprobs from 0: no prefix-cache hit, so every request computes every token
        # the same way and the KV is the same bytes each time.
        result = router.prefill(PROMPT, room, return_logprob=True, logprob_start_len=0)
        assert result.status is OutcomeStatus.OK, result

        def settled() -> bool:
            for rank in ranks:
                rank.receiver.progress()
            return all(r.receiver.poll(room).state is not RoomState.PENDING for r in ranks)

        wait_until(settled, 60.0, f"decode TP {tp_size}'s ranks")
        for rank in ranks:
            assert rank.receiver.poll(room).state is RoomState.DONE, rank.receiver.poll(room)
            assert rank.receiver.read_aux(rank.slot).first_token_id == result.first_token_id
    finally:
        for rank in ranks:
            rank.receiver.close()
    return ranks


@pytest.fixture(scope="module")
def router(shared_worker) -> Iterator[BlockingRouterClient]:  # type: ignore[no-untyped-def]
    client = BlockingRouterClient(shared_worker.ingress)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference(shared_worker, router) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """What a TP-1 decode received: per layer, K and V ``[NUM_TOKENS, KV, D]``."""
    (rank,) = _receive(shared_worker, router, 2701, 1)
    return [rank.kv(layer) for layer in range(NUM_LAYERS)]


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_a_tp_decode_gets_the_tp1_kv_head_by_head(
    shared_worker, router, reference, tp_size: int
) -> None:  # type: ignore[no-untyped-def]
    ranks = _receive(shared_worker, router, 2700 + 10 * tp_size, tp_size)
    for layer, (k_ref, v_ref) in enumerate(reference):
        per_rank = [rank.kv(layer) for rank in ranks]
        k = gather_kv_heads([k for k, _ in per_rank], NUM_KV_HEADS)
        v = gather_kv_heads([v for _, v in per_rank], NUM_KV_HEADS)
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), layer
    assert reference[0][0].abs().sum() > 0  # the reference itself landed
