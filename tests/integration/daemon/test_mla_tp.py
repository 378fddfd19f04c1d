"""An MLA model (``deepseek_v3`` tiny) served by a TP-2 worker, over the native protocol.

Every rank of the worker holds the same latent rows (the latent projections are replicated),
and the one rule that says who writes them is ``transfer.headplan``'s: an MLA pool is the
one-head, replicated case, so into a decode rank j of TP d the prefill rank j * p // d writes
(SGLang's ``target_tp_rank`` for MLA, too). Proven here with one worker (two rank processes,
gloo on CPU), fp32:

- a native decode of TP 1 (``KVReceiver.from_tensors(latents, [])``) receives, for a chunked
  prompt, every layer's latent rows within 1e-4 of transformers' cache, the first token in
  the aux row, DONE; and only rank 0 wrote: the follower's
  ``prefill_worker_tp_write_bytes_total{rank="1"}`` did not move for the room (the bytes it
  reports to the leader in its step answers), rank 0's moved by the latent and the aux row;
- a native decode of TP 2 (a receiver per rank, each over a whole latent pool) receives the
  same rows on both ranks, byte for byte what the TP-1 decode received (the TP-2 forward is
  deterministic: the same prompt is recomputed, bit for bit), rank 1's from rank 1: its
  series moved by exactly the room's latent pages, and the group's
  ``prefill_worker_transfer_bytes_total`` by the sum over ranks;
- the worker's page and aux pools are whole afterwards (the followers allocate nothing: the
  leader's page ids index every rank's pool), and SIGTERM drains every rank to exit 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import (
    DECODE_PAGES,
    PAGE_SIZE,
    Worker,
    decode_pool,
    start_worker,
    wait_ready,
)
from tests.integration.model.conftest import hf_mla_forward
from tests.patience import patient
from tests.polling import wait_until

TOL = 1e-4
CHUNKED = prompt(23, seed=2901)  # two chunks of 16 (configs/tiny-test.yaml), 6 pages
ROOM_D1, ROOM_D2 = 2901, 2902


class LatentDecode:
    """A native decode of TP ``tp_size`` over an MLA pool: a receiver per rank, each over a
    whole latent pool of its own (the latent is not split), each wanting the room with its
    own scattered pages."""

    def __init__(self, bootstrap: str, tp_size: int) -> None:
        layout = describe_worker(bootstrap, 30.0)
        assert (layout.kind, layout.num_kv_heads) == ("mla", 1), layout
        self.pools = [
            decode_pool("mla", 1, layout.head_dim, layout.num_layers)[0] for _ in range(tp_size)
        ]
        self.receivers = [
            KVReceiver.from_tensors(
                latents,
                [],
                bootstrap,
                num_aux_rows=4,
                io_thread=True,
                tp=None if tp_size == 1 else (rank, tp_size, 1),
            )
            for rank, latents in enumerate(self.pools)
        ]
        self.first_token_id = -1  # the last room's, from the router's reply
        self.pages = [
            [DECODE_PAGES - 1 - 3 * i - rank for i in range(-(-len(CHUNKED) // PAGE_SIZE))]
            for rank in range(tp_size)
        ]
        try:
            for receiver in self.receivers:
                receiver.wait_registered(timeout_s=patient(30))
        except BaseException:
            self.close()
            raise

    def receive(self, router: BlockingRouterClient, room: int) -> list[list[torch.Tensor]]:
        """CHUNKED into ``room``: per rank, per layer, the rows landed ``[tokens, latent]``."""
        for receiver, pages in zip(self.receivers, self.pages, strict=True):
            receiver.want(room, pages, 1, 0)
        # Prompt logprobs from 0: no prefix-cache hit, every request computes every token.
        result = router.prefill(CHUNKED, room, return_logprob=True, logprob_start_len=0)
        assert result.status is OutcomeStatus.OK, result
        assert result.num_computed_tokens == len(CHUNKED)

        def settled() -> bool:
            return all(r.poll(room).state is not RoomState.PENDING for r in self.receivers)

        wait_until(settled, 60.0, f"room {room} on every decode rank")
        for receiver in self.receivers:
            assert receiver.poll(room).state is RoomState.DONE, receiver.poll(room)
            assert receiver.read_aux(1).first_token_id == result.first_token_id
        self.first_token_id = result.first_token_id
        return [
            [torch.cat([layer[p] for p in pages])[: len(CHUNKED), 0] for layer in pool]
            for pool, pages in zip(self.pools, self.pages, strict=True)
        ]

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


@dataclass
class Served:
    worker: Worker  # still serving: SIGTERM drains it at the module's end
    checkpoint: Path
    d1: list[list[torch.Tensor]]  # the TP-1 decode: [rank 0][layer] rows
    d2: list[list[torch.Tensor]]  # the TP-2 decode: [rank][layer] rows
    first_token_id: int
    written: dict[int, tuple[float, ...]]  # by room: what written() moved by over it
    latent_bytes: int  # the room's latent pages, every layer: one decode rank's KV


def pool_usage(worker: Worker) -> dict[str, float]:
    """KV pages and aux rows held, and requests queued or running, as /metrics says."""
    status, text = worker.http("/metrics")
    assert status == 200, text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    usage = {"live_requests": 0.0}
    for sample in samples:
        if sample.name in ("prefill_worker_kv_pages_used", "prefill_worker_aux_rows_used"):
            usage[sample.name.removeprefix("prefill_worker_")] = sample.value
        elif sample.name == "prefill_worker_queue_requests":
            usage["live_requests"] += sample.value
    return usage


def written(worker: Worker) -> tuple[float, ...]:
    """The group's bytes written (``prefill_worker_transfer_bytes_total``), then each rank's
    (``prefill_worker_tp_write_bytes_total{rank}``), as /metrics says."""
    status, text = worker.http("/metrics")
    assert status == 200, text
    samples = {
        (s.name, s.labels.get("rank")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    ranks = [samples[("prefill_worker_tp_write_bytes_total", str(r))] for r in range(2)]
    return samples[("prefill_worker_transfer_bytes_total", None)], *ranks


def moved(before: tuple[float, ...], after: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(b - a for a, b in zip(before, after, strict=True))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp_path = tmp_path_factory.mktemp("mla-tp")
    checkpoint = make_checkpoint("deepseek_v3", tmp_path / "dsv3")
    worker: Worker = start_worker(tmp_path, checkpoint, "parallel.tp_size=2")
    try:
        wait_ready(worker)
        router = BlockingRouterClient(worker.ingress)
        decodes = [LatentDecode(worker.bootstrap, size) for size in (1, 2)]
        layout = describe_worker(worker.bootstrap, 30.0)
        latent_bytes = len(decodes[0].pages[0]) * layout.num_layers * layout.page_bytes
        try:
            before = written(worker)
            d1 = decodes[0].receive(router, ROOM_D1)
            after_d1 = written(worker)
            d2 = decodes[1].receive(router, ROOM_D2)
            after_d2 = written(worker)
        finally:
            for decode in decodes:
                decode.close()
            router.close()
        by_room = {ROOM_D1: moved(before, after_d1), ROOM_D2: moved(after_d1, after_d2)}
        yield Served(worker, checkpoint, d1, d2, decodes[0].first_token_id, by_room, latent_bytes)
        assert worker.child.stop() == 0, worker.log()  # SIGTERM drains every rank
    finally:
        worker.child.kill()


def test_a_tp1_decode_gets_transformers_latent_from_rank_0_alone(served: Served) -> None:
    logits, hf_rows = hf_mla_forward(hf_model(served.checkpoint), CHUNKED)
    assert served.first_token_id == int(logits[-1].argmax())
    (rows,) = served.d1
    for layer, (got, want) in enumerate(zip(rows, hf_rows, strict=True)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=f"layer {layer}")
    total, rank0, rank1 = served.written[ROOM_D1]
    assert rank1 == 0  # the follower wrote nothing
    assert rank0 == served.latent_bytes + AUX_ROW_BYTES  # the leader: every page, the aux row
    assert total == rank0


def test_each_rank_of_a_tp2_decode_is_written_by_its_own_rank(served: Served) -> None:
    total, rank0, rank1 = served.written[ROOM_D2]
    assert rank1 == served.latent_bytes  # the follower: every latent page into its rank
    assert rank0 == served.latent_bytes + 2 * AUX_ROW_BYTES  # the same into rank 0; an aux
    # row into each decode rank
    assert total == rank0 + rank1


def test_a_tp2_decode_gets_the_same_latent_on_each_rank(served: Served) -> None:
    (reference,) = served.d1
    for rank, rows in enumerate(served.d2):
        for layer, (got, want) in enumerate(zip(rows, reference, strict=True)):
            assert torch.equal(got, want), (rank, layer)
    assert reference[0].abs().sum() > 0  # the rows landed


def test_the_pools_are_whole_afterwards(served: Served) -> None:
    """Every page and aux row back (the reply can go out before the row is counted free)."""
    whole = {"kv_pages_used": 0.0, "aux_rows_used": 0.0, "live_requests": 0.0}
    usage: list[dict[str, float]] = []

    def is_whole() -> bool:
        usage.append(pool_usage(served.worker))
        return usage[-1] == whole

    try:
        wait_until(is_whole, 10.0, "the pools whole")
    except AssertionError:
        assert usage[-1] == whole  # names what is still held
        raise
