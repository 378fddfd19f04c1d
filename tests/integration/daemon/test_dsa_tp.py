"""A DSA model (``deepseek_v32`` tiny: MLA plus the lightning indexer, fp32) served by a TP-2
worker over the native protocol, into native decodes of TP 1 and 2 (the decode SDK, real
NIXL, one worker of two rank processes, gloo on CPU).

Every rank of the worker holds the same latent rows and the same index keys (the latent
projections and the indexer are replicated: docs/parallelism.md, "DeepSeek-V3.2 and GLM-5").
The latent pages are written as an MLA model's (``transfer.headplan``'s replicated one-head
case: into decode rank j of TP d the prefill rank j * p // d writes); the index pages, the
paged ``index_keys`` component, are the leader's alone, into every decode rank with each
chunk (``transfer/push/sender.py``), as it does for SGLang decodes. Proven:

- a decode of TP 1 receives a chunked prompt's (37 tokens, chunks of 16, top-k 12) latent
  rows and index keys, every layer's, within 1e-4 of transformers'; only the leader wrote
  (the follower's ``prefill_worker_tp_write_bytes_total{rank="1"}`` did not move; the
  leader's moved by the room's latent pages, its index pages and the aux row);
- a decode of TP 2 (a receiver per rank, each over a whole latent pool and a whole index
  pool) receives a prompt whose first 32 tokens the worker's prefix cache serves (their rows
  and keys read from its pages) the same way on both ranks, byte for byte, within 1e-4 of
  transformers', and the cached prefix byte for byte as the TP-1 decode got it; rank 1's
  latent from the follower (its series moved by exactly the room's latent pages), every
  index page from the leader (its series moved by the latent and the index pages twice, one
  per decode rank, and an aux row into each);
- the worker's page and aux pools are whole afterwards and SIGTERM drains every rank to exit 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import RoomState, describe_worker
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import PAGE_SIZE, Worker, start_worker, wait_ready
from tests.integration.daemon.test_dsa_daemon import IndexDecode, check_landed
from tests.integration.daemon.test_hybrid_daemon import pools_whole
from tests.integration.daemon.test_mla_tp import moved, written
from tests.polling import wait_until

PROMPT_D1 = prompt(37, seed=6401)  # three chunks of 16 (configs/tiny-test.yaml)
PROMPT_D2 = PROMPT_D1[:32] + prompt(13, seed=6402)  # its first 32 tokens a prefix-cache hit
ROOM_D1, ROOM_D2 = 6401, 6402
INDEX_HEAD_DIM = 24  # tests/checkpoints.py


@dataclass
class Served:
    worker: Worker  # still serving: SIGTERM drains it at the module's end
    checkpoint: Path
    d1: IndexDecode  # closed: its tensors stay readable
    d2: list[IndexDecode]  # rank 0, rank 1
    written: dict[int, tuple[float, ...]]  # by room: the group's bytes, then rank 0's, 1's
    page_bytes: tuple[int, int]  # a page of every layer: latent, index keys


def receive(router: BlockingRouterClient, ranks: list[IndexDecode], room: int, ids: list[int]):  # type: ignore[no-untyped-def]
    """``ids`` into ``room``, wanted by every decode rank: the router's outcome, once every
    rank is DONE."""
    for rank in ranks:
        rank.want(room, len(ids))
    result = router.prefill(ids, room, timeout_s=60)
    assert result.status is OutcomeStatus.OK, result
    for rank in ranks:
        status = rank.wait([room])[room]
        assert status.state is RoomState.DONE, status
        assert rank.receiver.read_aux(rank.rooms[room][1]).first_token_id == result.first_token_id
    return result


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp_path = tmp_path_factory.mktemp("dsa-tp")
    checkpoint = make_checkpoint("deepseek_v32", tmp_path / "dsv32")
    worker = start_worker(tmp_path, checkpoint, "parallel.tp_size=2")
    try:
        wait_ready(worker)
        router = BlockingRouterClient(worker.ingress)
        d1 = IndexDecode(worker.bootstrap, io_thread=True)
        d2 = [IndexDecode(worker.bootstrap, (rank, 2), io_thread=True) for rank in range(2)]
        layout = describe_worker(worker.bootstrap, 30.0)
        component = d1.component
        index_page = len(component.layer_ids) * component.tensors[0].item_bytes
        pages = (layout.num_layers * layout.page_bytes, index_page)
        try:
            before = written(worker)
            first = receive(router, [d1], ROOM_D1, PROMPT_D1)
            after_d1 = written(worker)
            second = receive(router, d2, ROOM_D2, PROMPT_D2)
            after_d2 = written(worker)
        finally:
            for decode in (d1, *d2):
                decode.close()
            router.close()
        assert (first.num_prefix_hit_tokens, second.num_prefix_hit_tokens) == (0, 32)
        by_room = {ROOM_D1: moved(before, after_d1), ROOM_D2: moved(after_d1, after_d2)}
        yield Served(worker, checkpoint, d1, d2, by_room, pages)
        assert worker.child.stop() == 0, worker.log()  # SIGTERM drains every rank
    finally:
        worker.child.kill()


def test_the_index_component_is_the_models_own(served: Served) -> None:
    component = served.d1.component
    assert (component.kind, component.layer_ids) == ("index_keys", (0, 1, 2))
    assert component.tensors[0].item_shape == (PAGE_SIZE, INDEX_HEAD_DIM)
    assert served.page_bytes[1] == 3 * PAGE_SIZE * INDEX_HEAD_DIM * 4


def test_a_tp1_decode_gets_transformers_latent_and_index_keys_from_the_leader(
    served: Served,
) -> None:
    check_landed(served.d1, hf_model(served.checkpoint), ROOM_D1, PROMPT_D1)
    num_pages = len(served.d1.rooms[ROOM_D1][0])
    latent, index = (num_pages * b for b in served.page_bytes)
    total, rank0, rank1 = served.written[ROOM_D1]
    assert rank1 == 0  # the follower wrote nothing
    assert rank0 == latent + index + AUX_ROW_BYTES
    assert total == rank0


def test_each_rank_of_a_tp2_decode_gets_transformers_rows_and_keys(served: Served) -> None:
    zero, one = served.d2
    check_landed(zero, hf_model(served.checkpoint), ROOM_D2, PROMPT_D2)  # rank 1: equal to it
    n, d1 = len(PROMPT_D2), served.d1
    for layer in range(len(zero.k)):
        rows = zero.latent_rows(ROOM_D2, n, layer)
        assert torch.equal(rows, one.latent_rows(ROOM_D2, n, layer)), layer
        assert torch.equal(rows[:32], d1.latent_rows(ROOM_D1, 32, layer)), layer  # cached pages
    for slot_layer in range(len(zero.index)):
        keys = zero.index_keys(ROOM_D2, n, slot_layer)
        assert torch.equal(keys, one.index_keys(ROOM_D2, n, slot_layer)), slot_layer
        assert torch.equal(keys[:32], d1.index_keys(ROOM_D1, 32, slot_layer)), slot_layer


def test_the_follower_writes_rank_1_its_latent_and_the_leader_every_index_page(
    served: Served,
) -> None:
    num_pages = len(served.d2[0].rooms[ROOM_D2][0])
    latent, index = (num_pages * b for b in served.page_bytes)
    total, rank0, rank1 = served.written[ROOM_D2]
    assert rank1 == latent  # the follower: every latent page into decode rank 1, no index page
    assert rank0 == latent + 2 * index + 2 * AUX_ROW_BYTES
    assert total == rank0 + rank1


def test_the_pools_are_whole_afterwards(served: Served) -> None:
    wait_until(lambda: pools_whole(served.worker), 10.0, "every aux row and page back")
