"""Byte for byte, an MLA pool: this worker's SGLang backend (in this process, over a pool of
random bytes of kind ``mla``: one latent per token and layer) pushes into SGLang's own MLA
decode (``NixlKVReceiver`` over a real ``MLATokenToKVPool``, its manager told
``is_mla_backend``), page sizes 1 and 16, prompts in chunks, with and without a decode-held
prefix: every latent page lands where the decode asked, nothing else moves, SGLang's receiver
says Success. A decode whose pool is not that latent is refused, and learns why. Runs on each
version's shared decode process (``conftest.version``): no process of its own.

The real worker on a tiny DeepSeek-V3 (``MLA_FAMILIES``) into SGLang's MLA decode of
attention TP 1: at worker TP 1 against transformers' cache, and at worker TP 2 (the decode
asks rank 0 for real and sends rank 1 a dummy, both the leader's socket: docs/sglang.md,
"Workers with TP > 1") against the TP-1 worker's latent; and at worker TP 1 into SGLang's MLA
decode of attention TP 2 (two decode-side rank processes, each holding the whole latent: "An
MLA decode of attention TP > 1"), each rank's latent byte for byte the TP-1 decode's, and
at worker TP 2 into it (each decode rank asks its own worker rank) within 1e-4. The TP-2
cases on the newest pinned version (``PW_INTEROP_ALL=1``: every one), as
``test_decode_tp.py``."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.layout import MLA, KVLayout, KVRegions
from prefill_worker.request import FinishReason, OutcomeStatus
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.model.conftest import hf_mla_forward
from tests.interop.conftest import (
    Served,
    assert_pools_whole,
    launch,
    launch_tp,
    sglang_path,
)
from tests.interop.decodes import Landed, SglangDecode, new_room
from tests.interop.rig import PrefillRig, push
from tests.polling import wait_until

pytestmark = pytest.mark.interop

NUM_LAYERS, LATENT = 2, 48  # the latent: kv_lora_rank 32 + qk_rope_head_dim 16
WORKER_PAGES = 64
MLA_FAMILIES = ["deepseek_v3"]


class MlaWorker(PrefillRig):
    """The rig over an MLA pool: layer l's latent pages at ``base + l * region_bytes``."""

    def __init__(self, layout: KVLayout) -> None:
        super().__init__(layout, 4, "prefill-mla")

    def regions(self) -> KVRegions:
        base, lay = int(self.pool.ctypes.data), self.layout
        latents = tuple(base + layer * lay.region_bytes for layer in range(NUM_LAYERS))
        return KVRegions(lay, latents, (), "cpu", self.aux.base_addr, self.aux.num_rows)

    def page(self, layer: int, page: int) -> np.ndarray:
        start = layer * self.layout.region_bytes + page * self.layout.page_bytes
        return self.pool[start : start + self.layout.page_bytes]


def mla_layout(page_size: int, num_pages: int, latent: int = LATENT) -> KVLayout:
    return KVLayout(NUM_LAYERS, 1, latent, "bfloat16", page_size, num_pages, MLA)


@pytest.fixture
def mla_worker(request: pytest.FixtureRequest) -> Iterator[MlaWorker]:
    worker = MlaWorker(mla_layout(request.param, WORKER_PAGES))
    yield worker
    worker.backend.close()


@pytest.mark.parametrize("mla_worker", [1, 16], indirect=True, ids=["page1", "page16"])
def test_every_latent_byte_lands_where_the_mla_decode_asked(
    decode_process: SglangDecodeProcess, mla_worker: MlaWorker, tmp_path: Path
) -> None:
    worker, page_size = mla_worker, mla_worker.layout.page_size
    decode = SglangDecode(decode_process, worker.bootstrap, mla_layout(page_size, 48))
    rng = np.random.default_rng(12)
    for num_pages, num_held, chunk_pages in [(5, 0, 2), (7, 3, 3)]:
        room = int(rng.integers(1, 2**63))
        num_tokens = num_pages * page_size - (page_size // 2)  # a partial last page
        decode.want(room, num_tokens, num_held * page_size)
        aux, src = push(worker, room, num_tokens, chunk_pages)
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        assert landed.v == []
        for layer in range(NUM_LAYERS):
            for i in range(num_pages):
                got = landed.k[layer][i]
                if i < num_held:
                    assert (got == FILL_BYTE).all(), f"held page {i} written (layer {layer})"
                else:
                    assert np.array_equal(got, worker.page(layer, src[i])), (layer, i)
        assert landed.output_ids[0] == aux.first_token_id
        assert int(landed.bootstrap_room[0]) == room
        decode.free(room)
    worker.check_whole()


@pytest.mark.parametrize("mla_worker", [16], indirect=True, ids=["page16"])
def test_a_decode_that_is_not_this_latent_learns_why(
    decode_process: SglangDecodeProcess, mla_worker: MlaWorker
) -> None:
    """Another latent width: the page bytes differ, named with the worker's latent. An MHA
    decode: K and V of each layer, twice the regions of the worker's latents."""
    worker = mla_worker
    cases = [
        (mla_layout(16, 48, latent=64), "the page size, KV dtype or latent width differ"),
        (
            KVLayout(NUM_LAYERS, 2, 16, "bfloat16", 16, 48),
            "decode registered 4 KV regions; this worker's model has 2 layers (2 regions: "
            "the MLA latent of each)",
        ),
    ]
    rng = np.random.default_rng(6)
    for layout, why in cases:
        decode = SglangDecode(decode_process, worker.bootstrap, layout)
        room = int(rng.integers(1, 2**63))
        decode.want(room, 40)
        assert worker.drive(lambda: decode.state(room)[0] == "Failed")  # noqa: B023
        reason = str(decode.state(room)[1])
        assert "registration refused" in reason and why in reason, reason
    assert worker.backend.reject_counts.get("layout_mismatch") == 2
    worker.check_whole()


def hf_latents(checkpoint: Path, ids: list[int]) -> tuple[int, list[torch.Tensor]]:
    """transformers' greedy first token, and per layer what an MLA pool holds: the normalised
    latent then the roped key part (in SGLang's interleaved order, docs/models.md),
    ``[tokens, 1, kv_lora_rank + qk_rope_head_dim]``."""
    logits, rows = hf_mla_forward(hf_model(checkpoint), ids)
    return int(logits[-1].argmax()), [row.unsqueeze(1) for row in rows]


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_the_worker_serves_an_sglang_mla_decode(
    decode_process: SglangDecodeProcess, tmp_path: Path, family: str
) -> None:
    """``prefill-worker serve`` on an MLA model, SGLang's protocol: the decode sizes its MLA
    pool by the worker's ``/readyz`` layout; a held page stays untouched, the rest matches
    transformers' cache (fp32, 1e-4 of the largest value); SGLang's receiver says Success."""
    checkpoint = make_checkpoint(family, tmp_path / family)
    served = launch(tmp_path, checkpoint, 16, "float32", "sglang").ready()
    client = BlockingRouterClient(served.worker.ingress)
    try:
        kv = json.loads(served.worker.http("/readyz")[1])["kv_layout"]
        layout = KVLayout(
            kv["num_layers"], 1, kv["head_dim"], "float32", 16, 2048 // 16, kv["kind"]
        )
        assert kv["kind"] == MLA and kv["num_kv_heads"] == 1
        decode = SglangDecode(decode_process, served.sglang, layout)
        ids, room, held = prompt(45, seed=4), new_room(), 16
        decode.want(room, len(ids), held)
        result = client.prefill(ids, room, return_logprob=True)
        assert result.status is OutcomeStatus.OK, result
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        first_token, reference = hf_latents(checkpoint, ids)
        for layer, ref in enumerate(reference):
            raw = landed.k[layer]
            assert (raw[: held // 16] == FILL_BYTE).all(), "a held page was written"
            got = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.float32)
            got = got.view(-1, 1, layout.head_dim)[: len(ids)]
            atol = 1e-4 * float(ref.abs().max())
            torch.testing.assert_close(got[held:], ref[held:], atol=atol, rtol=0)
        assert landed.output_ids[0] == result.first_token_id == first_token
    finally:
        client.close()
        served.worker.child.kill()


def _latents(
    served: Served, decode_process: SglangDecodeProcess, ids: list[int], held: int, tmp_path: Path
) -> tuple[int, list[torch.Tensor]]:
    """One room from ``served`` into a fresh MLA decode (attention TP 1) holding ``held``
    tokens: the worker's first token (also the metadata row's) and, per layer, the prompt's
    latent rows as landed (a held page checked untouched); the receiver said Success."""
    kv = json.loads(served.worker.http("/readyz")[1])["kv_layout"]
    assert kv["kind"] == MLA and kv["num_kv_heads"] == 1
    layout = KVLayout(kv["num_layers"], 1, kv["head_dim"], "float32", 16, 2048 // 16, MLA)
    decode = SglangDecode(decode_process, served.sglang, layout)
    client = BlockingRouterClient(served.worker.ingress)
    try:
        room = new_room()
        decode.want(room, len(ids), held)
        # Prompt logprobs from 0: no prefix-cache hit, every token computed alike.
        result = client.prefill(ids, room, return_logprob=True, logprob_start_len=0)
        assert result.status is OutcomeStatus.OK, result
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
    finally:
        client.close()
    assert int(landed.output_ids[0]) == result.first_token_id
    assert int(landed.bootstrap_room[0]) == room and landed.v == []
    rows = []
    for raw in landed.k:
        assert (raw[: held // 16] == FILL_BYTE).all(), "a held page was written"
        got = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.float32)
        rows.append(got.view(-1, 1, layout.head_dim)[held : len(ids)])
    return result.first_token_id, rows


def _abort(served: Served, decode_process: SglangDecodeProcess) -> None:
    """The decode aborts a room before the router's request: its ABORT goes to both worker
    ranks (the leader's socket), and it may free the pages once an ABORT_ACK came from each
    rank it asked, its dummy's too (SGLang's ``is_abort_release_safe``); the request ends
    aborted by the decode, which says Failed."""
    kv = json.loads(served.worker.http("/readyz")[1])["kv_layout"]
    layout = KVLayout(kv["num_layers"], 1, kv["head_dim"], "float32", 16, 2048 // 16, MLA)
    decode = SglangDecode(decode_process, served.sglang, layout)
    client, room, ids = BlockingRouterClient(served.worker.ingress), new_room(), prompt(40, seed=9)
    try:
        decode.want(room, len(ids))
        decode.abort(room)
        wait_until(lambda: decode.acked(room), 20, "ABORT_ACK of both worker ranks")
        result = client.prefill(ids, room)
    finally:
        client.close()
    assert (result.status, result.reason) == (OutcomeStatus.ABORTED, FinishReason.ABORTED_BY_DECODE)
    assert decode.state(room)[0] == "Failed"


@pytest.mark.newest_sglang
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_a_tp2_worker_serves_an_sglang_mla_decode_the_tp1_workers_latent(
    sglang_version: str, decode_process: SglangDecodeProcess, tmp_path: Path, family: str
) -> None:
    """``prefill-worker serve`` at ``parallel.tp_size`` 2 on an MLA model, SGLang's
    protocol: SGLang's MLA decode (attention TP 1) sends rank 0 its request and rank 1 a
    dummy; rank 0 writes the latent once (headplan), the decode hears one KV_STATUS and says
    Success, the first token in its metadata row. The latent rows equal the TP-1 worker's
    within 1e-4 of the largest value (the TP-2 forward sums its attention output across
    ranks in another order; layer 0's are byte for byte), the first token the same. An
    aborted room is acknowledged for both ranks; both workers' pools end whole."""
    checkpoint = make_checkpoint(family, tmp_path / family)
    started = [launch_tp(tmp_path / f"tp{tp}", checkpoint, tp) for tp in (1, 2)]
    try:
        tp1, tp2 = (one.ready() for one in started)
        ids, held = prompt(45, seed=4), 16
        want_token, want = _latents(tp1, decode_process, ids, held, tmp_path)
        got_token, got = _latents(tp2, decode_process, ids, held, tmp_path)
        assert got_token == want_token
        for layer, (mine, ref) in enumerate(zip(got, want, strict=True)):
            atol = 1e-4 * float(ref.abs().max())
            torch.testing.assert_close(mine, ref, atol=atol, rtol=0, msg=f"layer {layer}")
        _abort(tp2, decode_process)
        for one in (tp1, tp2):
            assert_pools_whole(one.worker)
    finally:
        for one in started:
            one.worker.child.kill()


def _receive_latents(
    served: Served, decodes: Sequence[SglangDecode], ids: list[int], tmp_path: Path
) -> tuple[int, list[Landed]]:
    """One room from ``served`` into a decode of ``len(decodes)`` attention-TP ranks (each
    wants the room with its own pages): the worker's first token, and each rank's pages once
    every rank's receiver said Success, each with the first token and the room in its own
    metadata row."""
    client, room = BlockingRouterClient(served.worker.ingress), new_room()
    try:
        for decode in decodes:
            decode.want(room, len(ids))
        result = client.prefill(ids, room, return_logprob=True, logprob_start_len=0)
        assert result.status is OutcomeStatus.OK, result
        with ThreadPoolExecutor(len(decodes)) as pool:
            states = list(pool.map(lambda decode: decode.wait(room), decodes))
        assert states == [("Success", None)] * len(decodes)
        landed = [decode.landed(room, tmp_path) for decode in decodes]
    finally:
        client.close()
    for got in landed:
        assert int(got.output_ids[0]) == result.first_token_id
        assert int(got.bootstrap_room[0]) == room and got.v == []
    return result.first_token_id, landed


@pytest.mark.newest_sglang
@pytest.mark.parametrize("worker_tp", [1, 2], ids=["worker-tp1", "worker-tp2"])
def test_an_attention_tp2_mla_decode_gets_the_whole_latent_on_each_rank(
    sglang_version: str,
    decode_process: SglangDecodeProcess,
    checkpoint: Path,
    tmp_path: Path,
    worker_tp: int,
) -> None:
    """``prefill-worker serve`` on an MLA model, SGLang's protocol, into SGLang's MLA decode
    of attention TP 2 (two rank processes; each registers its own pool of the whole latent
    and asks for every room with its own pages and metadata row: at worker TP 1 both ask
    rank 0, ``required_dst_info_num`` 2; at worker TP 2 each asks its own rank). Each rank's
    latent rows are what SGLang's TP-1 decode received from the TP-1 worker: byte for byte
    from the TP-1 worker, within 1e-4 of the largest value from the TP-2 worker (its forward
    sums in another order); each rank says Success with the first token in its metadata
    row; the workers' pools end whole."""
    mla_checkpoint = make_checkpoint(MLA_FAMILIES[0], tmp_path / MLA_FAMILIES[0])
    started = [launch_tp(tmp_path / f"tp{tp}", mla_checkpoint, tp) for tp in sorted({1, worker_tp})]
    path = sglang_path(sglang_version)
    ranks = [
        SglangDecodeProcess(
            sys.executable, path, checkpoint, tmp_path / f"rank{r}.log", attn_tp=(r, 2)
        )
        for r in range(2)
    ]
    try:
        ready = [one.ready() for one in started]
        tp1, serving = ready[0], ready[-1]
        kv = json.loads(tp1.worker.http("/readyz")[1])["kv_layout"]
        assert kv["kind"] == MLA and kv["num_kv_heads"] == 1
        layout = KVLayout(kv["num_layers"], 1, kv["head_dim"], "float32", 16, 2048 // 16, MLA)
        ids = prompt(45, seed=4)
        ref_token, ref = _receive_latents(
            tp1, [SglangDecode(decode_process, tp1.sglang, layout)], ids, tmp_path
        )
        decodes = [SglangDecode(process, serving.sglang, layout) for process in ranks]
        token, got = _receive_latents(serving, decodes, ids, tmp_path)
        assert token == ref_token
        row = layout.head_dim * 4
        for layer in range(layout.num_layers):
            want = ref[0].k[layer].reshape(-1, row)[: len(ids)]
            for rank, landed in enumerate(got):
                mine = landed.k[layer].reshape(-1, row)[: len(ids)]
                if worker_tp == 1:
                    assert np.array_equal(mine, want), (rank, layer)
                else:
                    expect = want.view(np.float32)
                    atol = 1e-4 * float(np.abs(expect).max())
                    got_f = mine.view(np.float32)
                    np.testing.assert_allclose(got_f, expect, atol=atol, rtol=0)
        for one in ready:
            assert_pools_whole(one.worker)
    finally:
        for process in ranks:
            process.close()
        for one in started:
            one.worker.child.kill()
