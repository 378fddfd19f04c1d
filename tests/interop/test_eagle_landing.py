"""An EAGLE-3 draft's KV and first proposal in SGLang 0.5.23's own speculating decode.

Byte for byte: this worker's SGLang backend (in this process, over a layer-major pool of
random bytes and a one-layer draft pool of random bytes beside it, ``transfer.draft``) pushes
into a decode whose layer-major (MHA) pools hold the target's layers and, after them, a
one-layer draft pool (``num_draft_entries`` 2: its K and V): every target and draft K and V
page lands where the decode asked, a held page of either untouched, the row SGLang's
``get_buf`` reads holds the worker's top-k and hidden state.

From the model: ``prefill-worker serve`` with ``model.draft: eagle3`` on a tiny random Llama
and its tiny random EAGLE-3 draft (``tests/eagle_checkpoints.py``), a decode whose layer-major
(MHA) pools hold the target's 4 layers and, after them, a one-layer draft pool of the same
geometry (``num_draft_entries`` 2: its K and V), its ``MetadataBuffers`` sized for the draft's
hidden state. The draft pool's K and V past a held page, the row's top-k and hidden state equal
the reference written from the draft's definition (``test_eagle_draft.reference``) within 1e-4;
the held page of the draft pool is untouched; the worker's pools whole after. The worker at TP 1
and at TP 2 (one KV head per rank: each rank writes token runs of its head of the target's and
the draft's layers into the decode's two-head pools, the leader the metadata row). On the
version's shared decode process, 0.5.23 only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from prefill_worker.batch import DraftRow
from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout, KVRegions
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from prefill_worker.transfer.draft import DraftSide
from tests.checkpoints import hf_model, prompt
from tests.eagle_checkpoints import HEAD_DIM, HIDDEN, KV_HEADS, target_and_draft
from tests.integration.model import test_eagle_draft
from tests.interop.conftest import assert_pools_whole, launch
from tests.interop.decodes import SglangDecode, new_room
from tests.interop.rig import PrefillRig, push

pytestmark = pytest.mark.interop


@pytest.fixture
def latest(sglang_version: str, decode_process: SglangDecodeProcess) -> SglangDecodeProcess:
    if sglang_version != "0.5.23":
        pytest.skip("the draft handoff is proven against SGLang 0.5.23's decode")
    return decode_process


class MhaDraftWorker(PrefillRig):
    """A layer-major pool of 2 layers (2 heads of 16, fp32) and a one-layer draft pool of
    the same pages, both random bytes; proposals of a ``HIDDEN``-wide fp32 hidden state."""

    def __init__(self) -> None:
        layout = KVLayout(2, KV_HEADS, HEAD_DIM, "float32", 16, 32, LAYER_MAJOR)
        draft_layout = KVLayout(1, KV_HEADS, HEAD_DIM, "float32", 16, 32, LAYER_MAJOR)
        rng = np.random.default_rng(46)
        self.draft_pool = rng.integers(0, 256, draft_layout.pool_bytes, dtype=np.uint8)
        self.rows = DraftRows(8, HIDDEN * 4)
        base, step = int(self.draft_pool.ctypes.data), draft_layout.region_bytes
        regions = KVRegions(draft_layout, (base,), (base + step,), "cpu", self.rows.base_addr, 8)
        super().__init__(layout, 5, "prefill-eagle", draft=DraftSide(regions, self.rows))

    def regions(self) -> KVRegions:
        base, lay = int(self.pool.ctypes.data), self.layout
        starts = [base + region * lay.region_bytes for region in range(2 * lay.num_layers)]
        return KVRegions(lay, tuple(starts[:2]), tuple(starts[2:]), "cpu", self.aux.base_addr, 8)

    def page(self, region: int, page: int) -> np.ndarray:
        """Regions: K0 K1 V0 V1 of the target, then K, V of the draft (4, 5)."""
        pool, size = (self.pool, region) if region < 4 else (self.draft_pool, region - 4)
        start = size * self.layout.region_bytes + page * self.layout.page_bytes
        return pool[start : start + self.layout.page_bytes]

    def propose(self, row: int) -> DraftRow:
        rng = np.random.default_rng(row)
        hidden = rng.standard_normal(HIDDEN).astype("<f4").tobytes()
        draft = DraftRow((0.5, 0.25), (7 + row, 95), hidden)
        self.rows.write(row, draft)
        return draft


def test_the_draft_k_and_v_land_byte_for_byte(latest: SglangDecodeProcess, tmp_path: Path) -> None:
    worker = MhaDraftWorker()
    try:
        layout = KVLayout(2, KV_HEADS, HEAD_DIM, "float32", 16, 24, LAYER_MAJOR)
        decode = SglangDecode(
            latest, worker.bootstrap, layout, 8, speculates=(1, HIDDEN, "float32")
        )
        room, num_tokens, held = new_room(), 5 * 16 - 3, 2
        decode.want(room, num_tokens, held * 16)
        proposals: list[DraftRow] = []
        _, src = push(
            worker, room, num_tokens, 2, on_aux_row=lambda r: proposals.append(worker.propose(r))
        )
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        planes = [*landed.k, *landed.v, *landed.draft_k, *landed.draft_v]
        assert len(planes) == 6
        for region, pages in enumerate(planes):
            for i, got in enumerate(pages):
                if i < held:
                    assert (got == FILL_BYTE).all(), f"held page {i} written (region {region})"
                else:
                    assert np.array_equal(got, worker.page(region, src[i])), (region, i)
        assert landed.topk_index.view("<i8").tolist() == [*proposals[0].topk_index] + [0] * 14
        assert landed.hidden.tobytes() == proposals[0].hidden
        decode.free(room)
        worker.check_whole()
    finally:
        worker.backend.close()


def rows(pages: np.ndarray, length: int) -> torch.Tensor:
    """A pool's raw pages ``[pages, page_bytes]`` as fp32 rows ``[length, KV, D]``."""
    got = torch.frombuffer(bytearray(pages.tobytes()), dtype=torch.float32)
    return got.view(-1, KV_HEADS, HEAD_DIM)[:length]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_worker_sends_its_eagle3_draft_to_a_speculating_decode(
    latest: SglangDecodeProcess, tmp_path: Path, tp_size: int
) -> None:
    target, draft = target_and_draft(tmp_path / "ckpt", "eagle3")
    k = test_eagle_draft.TOPK
    settings = ("model.draft=eagle3", f"model.draft_path={draft}", f"model.draft_topk={k}")
    settings += (f"parallel.tp_size={tp_size}",)
    served = launch(tmp_path, target, 16, "float32", "sglang", "layer_major", *settings).ready()
    client = BlockingRouterClient(served.worker.ingress)
    try:
        num_layers = json.loads(served.worker.http("/readyz")[1])["kv_layout"]["num_layers"]
        layout = KVLayout(num_layers, KV_HEADS, HEAD_DIM, "float32", 16, 128, LAYER_MAJOR)
        decode = SglangDecode(latest, served.sglang, layout, 8, speculates=(1, HIDDEN, "float32"))
        ids, room, held = prompt(45, seed=9), new_room(), 16
        decode.want(room, len(ids), held)
        result = client.prefill(ids, room)
        assert result.status is OutcomeStatus.OK, result
        assert decode.wait(room) == ("Success", None)
        landed = decode.landed(room, tmp_path)
        tensors = load_file(draft / "model.safetensors")
        first, topk_p, topk_index, hidden, ref_k, ref_v = test_eagle_draft.reference(
            "eagle3", hf_model(target), tensors, ids
        )
        assert landed.output_ids[0] == result.first_token_id == first
        assert len(landed.draft_k) == len(landed.draft_v) == 1
        for raw, ref in ((landed.draft_k[0], ref_k), (landed.draft_v[0], ref_v)):
            assert (raw[: held // 16] == FILL_BYTE).all(), "a held draft page was written"
            got = rows(raw, len(ids))[held:]
            torch.testing.assert_close(got, ref[held:], atol=1e-4, rtol=0)
        assert landed.topk_index.view("<i8")[:k].tolist() == topk_index.tolist()
        got_p = torch.from_numpy(landed.topk_p.view("<f4")[:k].copy())
        torch.testing.assert_close(got_p, topk_p, atol=1e-4, rtol=0)
        got_hidden = torch.from_numpy(landed.hidden.view("<f4").copy())
        # At TP 2 the residual sums the ranks' o and down projections (and the target's, four
        # layers before): its larger entries move by more than 1e-4 in the last bits.
        rtol = 0 if tp_size == 1 else 1e-3
        torch.testing.assert_close(got_hidden, hidden, atol=1e-4, rtol=rtol)
        assert_pools_whole(served.worker)
    finally:
        client.close()
        served.worker.child.kill()
