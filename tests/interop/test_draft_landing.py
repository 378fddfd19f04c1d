"""A draft's KV and first proposal into SGLang 0.5.23's own speculating decode, byte for byte:
this worker's SGLang backend (in this process, over an MLA pool of random bytes and a
one-layer draft pool beside it, ``transfer.draft``) pushes into a decode that registered a
draft pool after its target pool (``NixlKVReceiver`` over real ``MLATokenToKVPool``s, its
``num_draft_entries`` 1, its ``MetadataBuffers`` sized for the draft's hidden state, as an
EAGLE/MTP decode builds them). Every target and draft page lands where the decode asked, a
held page of either stays untouched, the row SGLang's ``get_buf`` reads holds the worker's
top-k and hidden state. A decode that does not speculate is served the target alone; a
worker without a draft serves a speculating decode the target alone, its draft pool and
hidden row untouched (SGLang's prefill without speculative decoding). Pools whole after.
On the version's shared decode process, 0.5.23 only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from prefill_worker.batch import DraftRow
from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import MLA, KVLayout, KVRegions
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from prefill_worker.transfer.draft import DraftSide
from tests.checkpoints import hf_model, prompt, with_mtp_layer
from tests.integration.model import test_mtp_draft
from tests.interop.conftest import assert_pools_whole, launch
from tests.interop.decodes import Landed, SglangDecode, new_room
from tests.interop.rig import PrefillRig, push
from tests.interop.test_mla_landing import NUM_LAYERS, mla_layout

pytestmark = pytest.mark.interop

PAGE, WORKER_PAGES, HIDDEN = 16, 64, 24  # the draft's hidden state: 24 float32
SPECULATES = (1, HIDDEN, "float32")  # one draft layer, as DeepSeek-V3's MTP decode


class DraftWorker(PrefillRig):
    """An MLA pool of ``NUM_LAYERS`` latents and, with ``has_draft``, a one-layer draft pool
    and proposals of ``HIDDEN`` float32, each random."""

    def __init__(self, has_draft: bool) -> None:
        layout = mla_layout(PAGE, WORKER_PAGES)
        rng = np.random.default_rng(45)
        self.draft_pool = rng.integers(0, 256, layout.region_bytes, dtype=np.uint8)
        self.rows = DraftRows(8, HIDDEN * 4)
        draft_layout = dataclasses.replace(layout, num_layers=1)
        base = int(self.draft_pool.ctypes.data)
        regions = KVRegions(draft_layout, (base,), (), "cpu", self.rows.base_addr, 8)
        draft = DraftSide(regions, self.rows) if has_draft else None
        super().__init__(layout, 4, "prefill-draft", draft=draft)

    def regions(self) -> KVRegions:
        base, lay = int(self.pool.ctypes.data), self.layout
        latents = tuple(base + layer * lay.region_bytes for layer in range(NUM_LAYERS))
        return KVRegions(lay, latents, (), "cpu", self.aux.base_addr, self.aux.num_rows)

    def page(self, layer: int, page: int) -> np.ndarray:
        """Layer ``NUM_LAYERS`` is the draft's."""
        start, size = page * self.layout.page_bytes, self.layout.page_bytes
        if layer == NUM_LAYERS:
            return self.draft_pool[start : start + size]
        start += layer * self.layout.region_bytes
        return self.pool[start : start + size]

    def propose(self, row: int) -> DraftRow:
        """A proposal of its own for each aux row (a row mixed up shows)."""
        rng = np.random.default_rng(row)
        hidden = rng.standard_normal(HIDDEN).astype("<f4").tobytes()
        draft = DraftRow((0.5, 0.25 - row / 100, 0.125), (7 + row, 300, 11), hidden)
        self.rows.write(row, draft)
        return draft


@pytest.fixture
def latest(sglang_version: str, decode_process: SglangDecodeProcess) -> SglangDecodeProcess:
    if sglang_version != "0.5.23":
        pytest.skip("the draft handoff is proven against SGLang 0.5.23's decode")
    return decode_process


def serve(
    worker: DraftWorker, decode: SglangDecode, held: int, tmp_path: Path
) -> tuple[Landed, list[int], DraftRow | None]:
    """One room of 5 pages (the last partial) in chunks of 2 pages, ``held`` pages held."""
    room, num_tokens = new_room(), 5 * PAGE - 3
    decode.want(room, num_tokens, held * PAGE)
    proposals: list[DraftRow] = []
    _, src = push(
        worker, room, num_tokens, 2, on_aux_row=lambda row: proposals.append(worker.propose(row))
    )
    assert decode.wait(room) == ("Success", None)
    landed = decode.landed(room, tmp_path)
    assert int(landed.bootstrap_room[0]) == room
    decode.free(room)
    return landed, src, proposals[0]


def assert_pages(landed: list[np.ndarray], worker: DraftWorker, layer: int, src: list[int],
                 held: int) -> None:  # fmt: skip
    for i, got in enumerate(landed):
        if i < held:
            assert (got == FILL_BYTE).all(), f"held page {i} written (layer {layer})"
        else:
            assert np.array_equal(got, worker.page(layer, src[i])), (layer, i)


def test_the_draft_kv_and_rows_land_in_a_speculating_decode(
    latest: SglangDecodeProcess, tmp_path: Path
) -> None:
    worker = DraftWorker(has_draft=True)
    try:
        decode = SglangDecode(
            latest, worker.bootstrap, mla_layout(PAGE, 48), 8, speculates=SPECULATES
        )
        for held in (0, 2):
            landed, src, draft = serve(worker, decode, held, tmp_path)
            assert draft is not None and len(landed.draft_k) == 1 and landed.draft_v == []
            for layer in range(NUM_LAYERS):
                assert_pages(landed.k[layer], worker, layer, src, held)
            assert_pages(landed.draft_k[0], worker, NUM_LAYERS, src, held)
            topk_p, topk_index = landed.topk_p.view("<f4"), landed.topk_index.view("<i8")
            assert topk_p[:3].tolist() == list(np.float32(draft.topk_p)) and not topk_p[3:].any()
            assert topk_index.tolist() == [*draft.topk_index] + [0] * 13
            assert landed.hidden.tobytes() == draft.hidden
        plain = SglangDecode(latest, worker.bootstrap, mla_layout(PAGE, 48), 8)
        landed, src, _ = serve(worker, plain, 0, tmp_path)  # no draft pool: the target only
        for layer in range(NUM_LAYERS):
            assert_pages(landed.k[layer], worker, layer, src, 0)
        assert landed.draft_k == [] and not landed.topk_p.any() and not landed.hidden.any()
        worker.check_whole()
    finally:
        worker.backend.close()


def test_a_worker_without_a_draft_serves_a_speculating_decode_its_target(
    latest: SglangDecodeProcess, tmp_path: Path
) -> None:
    worker = DraftWorker(has_draft=False)
    try:
        decode = SglangDecode(
            latest, worker.bootstrap, mla_layout(PAGE, 48), 8, speculates=SPECULATES
        )
        landed, src, _ = serve(worker, decode, 0, tmp_path)
        for layer in range(NUM_LAYERS):
            assert_pages(landed.k[layer], worker, layer, src, 0)
        assert all((page == FILL_BYTE).all() for page in landed.draft_k[0]), "draft written"
        assert (landed.hidden == FILL_BYTE).all(), "the hidden row was written"
        assert not landed.topk_p.any() and not landed.topk_index.any()
        worker.check_whole()
    finally:
        worker.backend.close()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_worker_sends_its_mtp_draft_to_a_speculating_decode(
    latest: SglangDecodeProcess, tmp_path: Path, tp_size: int
) -> None:
    """``prefill-worker serve`` with ``model.draft: mtp`` on a tiny DeepSeek-V3 with an MTP
    layer: the engine's draft rows and draft pool reach the decode. Its draft pool rows past a
    held page and its row's top-k and hidden state equal the reference written from the
    model's definition (``test_mtp_draft.reference``) within 1e-4; the held page untouched.
    At TP 2 every rank holds the whole latent of the target's and the draft's layers, and the
    leader alone writes them into the TP-1 decode (``transfer.headplan``)."""
    target = with_mtp_layer(tmp_path / "ckpt")
    settings = ("model.draft=mtp", f"model.draft_topk={test_mtp_draft.TOPK}")
    settings += (f"parallel.tp_size={tp_size}",)
    served = launch(tmp_path, target, 16, "float32", "sglang", "layer_major", *settings).ready()
    client = BlockingRouterClient(served.worker.ingress)
    try:
        kv = json.loads(served.worker.http("/readyz")[1])["kv_layout"]
        layout = KVLayout(kv["num_layers"], 1, kv["head_dim"], "float32", 16, 128, MLA)
        hidden_size = json.loads((target / "config.json").read_text())["hidden_size"]
        speculates = (1, hidden_size, "float32")
        decode = SglangDecode(latest, served.sglang, layout, 8, speculates=speculates)
        ids, room, held = prompt(45, seed=8), new_room(), 16
        decode.want(room, len(ids), held)
        result = client.prefill(ids, room)
        assert result.status is OutcomeStatus.OK, result
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        hf = (hf_model(target), hf_model(tmp_path / "ckpt" / "donor"))
        tensors = load_file(target / "model.safetensors")
        first, topk_p, topk_index, hidden, rows = test_mtp_draft.reference(hf, tensors, ids)
        assert landed.output_ids[0] == result.first_token_id == first
        raw = landed.draft_k[0]
        assert (raw[: held // 16] == FILL_BYTE).all(), "a held draft page was written"
        got = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.float32)
        got = got.view(-1, layout.head_dim)[held : len(ids)]
        torch.testing.assert_close(got, rows[held:], atol=1e-4, rtol=0)
        k = test_mtp_draft.TOPK
        assert landed.topk_index.view("<i8")[:k].tolist() == topk_index.tolist()
        got_p = torch.from_numpy(landed.topk_p.view("<f4")[:k].copy())
        torch.testing.assert_close(got_p, topk_p, atol=1e-4, rtol=0)
        got_hidden = torch.from_numpy(landed.hidden.view("<f4").copy())
        torch.testing.assert_close(got_hidden, hidden, atol=1e-4, rtol=0)
        assert_pools_whole(served.worker)
    finally:
        client.close()
        served.worker.child.kill()
