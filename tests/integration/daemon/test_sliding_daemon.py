"""gpt-oss (sliding-window and full layers, sinks) and Gemma 3 (at TP 2) in the real daemon
with a native decode (the decode SDK, NIXL), full-pool mode: its published KV layout has
every layer, and a prompt longer than the window lands in the decode's pages with every full
layer's K/V at every position and every sliding layer's over the last ``window - 1``
positions (all a decode reads) equal to transformers', beside the first token transformers
picks. The pools are whole afterwards and the worker drains to exit 0. A windowed worker
(``cache.sliding_pool windowed``) sends the same from its sliding layers' own pages, whose
pages are held by no request afterwards (the prefix cache keeps the prompt's last window,
which the metric does not count), to a decode of TP 1 and to one of TP 2 (two
``KVReceiver`` ranks, a KV head each). At TP 2 the same (each rank computes and writes its
KV head, with its 3 query heads (gpt-oss: their sinks, half of every expert), into one decode
of TP 1: token runs of its head; windowed, into a decode of TP 2 too: whole pages of its
head, each rank's sliding pages the leader's, which the step names). At attention DP 2,
windowed, each DP rank sends its rooms from its own sliding pool. The KV events, windowed or
not, name only the model's full-attention KV-cache group, as vLLM 0.34 numbers the groups
(gpt-oss [L0] [L2] [L1]: group 2; Gemma 3 [L0] [L2] [L3] [L1]: group 3): a sliding page is
no reusable prefix."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.model.parallel import gather_kv_heads
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker
from prefill_worker.transfer.decode.ranks import rank_bootstrap
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import Decode, decode_pool, start_worker, wait_until
from tests.integration.daemon.test_hybrid_daemon import published_events
from tests.patience import patient

TOL = 1e-4


IDS = prompt(70, seed=11)
LAYERS = {"gpt_oss": 3, "gemma3": 4}  # layer 1 of each is full, the others slide (window 24)
FULL_GROUP = {"gpt_oss": 2, "gemma3": 3}  # vLLM 0.34's group of layer 1
KV_EVENTS = (
    "kv_events.enabled=true",
    "kv_events.publish_bind=tcp://127.0.0.1:0",
    "kv_events.replay_bind=tcp://127.0.0.1:0",
)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``reference(family)``: the checkpoint, and transformers' output (with its cache)
    for ``IDS``, made once per family."""
    made: dict[str, tuple] = {}

    def reference(family: str) -> tuple:
        if family not in made:
            checkpoint = make_checkpoint(family, tmp_path_factory.mktemp(family) / "ckpt")
            with torch.no_grad():
                made[family] = checkpoint, hf_model(checkpoint)(torch.tensor([IDS]), use_cache=True)
        return made[family]

    return reference


@pytest.mark.parametrize(
    ("family", "tp_size", "sliding_pool"),
    [
        ("gpt_oss", 1, "full"),
        ("gpt_oss", 1, "windowed"),
        ("gpt_oss", 2, "full"),
        ("gpt_oss", 2, "windowed"),
        ("gemma3", 2, "full"),
    ],
)
def test_a_sliding_prompt_lands_whole_at_a_native_decode(
    tmp_path: Path, references, family: str, tp_size: int, sliding_pool: str
) -> None:  # type: ignore[no-untyped-def]
    (checkpoint, out), ids = references(family), IDS
    windowed = sliding_pool == "windowed"
    overrides = ("cache.num_pages=32", f"parallel.tp_size={tp_size}", *KV_EVENTS)
    overrides += ("cache.sliding_pool=windowed",) if windowed else ()
    worker = start_worker(tmp_path, checkpoint, *overrides)
    try:
        worker.child.wait_ready(120)
        decode, router = Decode(worker.bootstrap), BlockingRouterClient(worker.ingress)
        assert len(decode.k) == LAYERS[family]  # every layer, sliding or full
        decode.want(4301, len(ids))
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(router.prefill, ids, 4301, timeout_s=60)
            status = decode.wait([4301])[4301]
            result = sent.result(60)
        assert result.status is OutcomeStatus.OK, result
        assert status.state is RoomState.DONE, status
        assert result.first_token_id == int(out.logits[0, -1].argmax())
        assert_landed(out, lambda layer: decode.kv(4301, len(ids), layer))
        if windowed:  # a decode of TP 2: each rank the window's pages of its head
            ranks = TwoRanks(worker.bootstrap)
            try:
                ranks.want(4302, len(ids))
                result = router.prefill(ids, 4302, timeout_s=60)
                assert result.status is OutcomeStatus.OK, result
                assert all(s.state is RoomState.DONE for s in ranks.wait(4302)), worker.log()
                assert_landed(out, lambda layer: ranks.kv(4302, len(ids), layer))
            finally:
                ranks.close()
        router.close()
        decode.close()

        def pools_whole() -> bool:
            metrics = worker.http("/metrics")[1]
            used = ("prefill_worker_aux_rows_used 0.0", "prefill_worker_kv_pages_used 0.0")
            if windowed:  # the sliding layers' own pages too
                used += ("prefill_worker_sliding_pages_used 0.0",)
            return all(line in metrics.splitlines() for line in used)

        wait_until(pools_whole, 30, "every aux row and page back")
        full_pages = len(ids) // 4

        def stored_events() -> list[dict[str, object]]:
            return [e for e in published_events(worker) if e["type"] == "BlockStored"]

        def stored_tokens() -> int:
            return sum(len(e["token_ids"]) for e in stored_events())  # type: ignore[arg-type]

        # the publisher thread sends a batch after the cache stored it: wait for the last one
        wait_until(lambda: stored_tokens() >= full_pages * 4, 30, "every full page's event")
        stored = stored_events()
        assert {(e["group_idx"], e["kv_cache_spec_kind"]) for e in stored} == {
            (FULL_GROUP[family], "full_attention")
        }
        assert not any("kv_cache_spec_sliding_window" in e for e in stored)
        tokens = [t for e in stored for t in e["token_ids"]]
        assert tokens == ids[: full_pages * 4]  # every full page of 4, once
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


def test_each_dp_rank_sends_its_own_windowed_pool(tmp_path: Path, references) -> None:  # type: ignore[no-untyped-def]
    """Attention DP 2, windowed: each DP rank (a whole TP-1 worker) holds its own sliding
    pool and sends its rooms' window from it to a native decode on its bootstrap."""
    checkpoint, out = references("gpt_oss")
    overrides = ("cache.num_pages=32", "parallel.dp_size=2", "cache.sliding_pool=windowed")
    worker = start_worker(tmp_path, checkpoint, *overrides)
    try:
        worker.child.wait_ready(120)
        endpoints = json.loads(worker.http("/readyz")[1])
        router = BlockingRouterClient(worker.ingress)
        for room in (4400, 4401):  # rank 0's, rank 1's
            decode = Decode(rank_bootstrap(endpoints, room))
            try:
                decode.want(room, len(IDS))
                with ThreadPoolExecutor(1) as pool:
                    sent = pool.submit(router.prefill, IDS, room, timeout_s=60)
                    status = decode.wait([room])[room]
                    result = sent.result(60)
                assert result.status is OutcomeStatus.OK, result
                assert status.state is RoomState.DONE, status
                assert_landed(out, lambda layer: decode.kv(room, len(IDS), layer))  # noqa: B023
            finally:
                decode.close()
        router.close()

        def pools_whole() -> bool:
            lines = worker.http("/metrics")[1].splitlines()
            return all(f"prefill_worker_{name}_used 0.0" in lines for name in POOLS)

        wait_until(pools_whole, 30, "every rank's aux rows, pages and sliding pages back")
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


POOLS = ("aux_rows", "kv_pages", "sliding_pages")


def assert_landed(out, kv) -> None:  # type: ignore[no-untyped-def]
    """Every full layer's K/V at every position and every sliding layer's window (what a
    decode reads) as ``kv(layer)`` landed them, within ``TOL`` of transformers' cache."""
    for layer, cached in enumerate(out.cache.layers):
        k_ref, v_ref = cached.keys[0].transpose(0, 1), cached.values[0].transpose(0, 1)
        kept = k_ref.shape[0]
        assert kept == (len(IDS) if layer == 1 else 23)
        k, v = kv(layer)
        torch.testing.assert_close(k[-kept:], k_ref, atol=TOL, rtol=1e-5)
        torch.testing.assert_close(v[-kept:], v_ref, atol=TOL, rtol=1e-5)


class TwoRanks:
    """A native decode of TP 2: two ranks (``KVReceiver``, ``register.tp``), a KV head each,
    in pools of the worker's layout; each wants the room with its own scattered pages."""

    def __init__(self, bootstrap: str) -> None:
        lay = describe_worker(bootstrap, 30.0)
        self.num_kv_heads, self.receivers = lay.num_kv_heads, []
        self.pools = [decode_pool(lay.kind, 1, lay.head_dim, lay.num_layers) for _ in range(2)]
        for rank, (k, v) in enumerate(self.pools):
            tp = (rank, 2, lay.num_kv_heads)
            receiver = KVReceiver.from_tensors(
                k, v, bootstrap, num_aux_rows=4, tp=tp, io_thread=True
            )
            self.receivers.append(receiver)
            receiver.wait_registered(timeout_s=patient(30))
        self.pages: list[list[int]] = []

    def want(self, room: int, num_tokens: int) -> None:
        count = -(-num_tokens // 4)
        self.pages = [[200 - 3 * i - rank for i in range(count)] for rank in range(2)]
        for rank, receiver in enumerate(self.receivers):
            receiver.want(room, self.pages[rank], rank, 0)

    def wait(self, room: int) -> list:  # type: ignore[type-arg]
        def settled() -> bool:
            for receiver in self.receivers:
                receiver.progress()
            return all(r.poll(room).state is not RoomState.PENDING for r in self.receivers)

        wait_until(settled, 60, f"room {room} at both decode ranks")
        return [receiver.poll(room) for receiver in self.receivers]

    def kv(self, room: int, num_tokens: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_tokens, KV, D]`` K and V, the ranks' heads put back together."""
        per_rank = [
            [torch.cat([pool[layer][p] for p in pages])[:num_tokens] for pool in (k, v)]
            for (k, v), pages in zip(self.pools, self.pages, strict=True)
        ]
        k = gather_kv_heads([k for k, _ in per_rank], self.num_kv_heads)
        v = gather_kv_heads([v for _, v in per_rank], self.num_kv_heads)
        return k, v

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()
