"""An EAGLE-3 draft's KV and first proposal in SGLang 0.5.23's own speculating decode:
``prefill-worker serve`` with ``model.draft: eagle3`` on a tiny random Llama and its tiny random
EAGLE-3 draft (``tests/eagle_checkpoints.py``), a decode whose layer-major (MHA) pools hold the
target's 4 layers and, after them, a one-layer draft pool of the same geometry
(``num_draft_entries`` 2: its K and V), its ``MetadataBuffers`` sized for the draft's hidden
state. The draft pool's K and V past a held page, the row's top-k and hidden state equal the
reference written from the draft's definition (``test_eagle_draft.reference``) within 1e-4;
the held page of the draft pool is untouched; the worker's pools whole after.
On the version's shared decode process, 0.5.23 only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from tests.checkpoints import hf_model, prompt
from tests.eagle_checkpoints import HEAD_DIM, HIDDEN, KV_HEADS, target_and_draft
from tests.integration.model import test_eagle_draft
from tests.interop.conftest import assert_pools_whole, launch
from tests.interop.decodes import SglangDecode, new_room

pytestmark = pytest.mark.interop


@pytest.fixture
def latest(sglang_version: str, decode_process: SglangDecodeProcess) -> SglangDecodeProcess:
    if sglang_version != "0.5.23":
        pytest.skip("the draft handoff is proven against SGLang 0.5.23's decode")
    return decode_process


def rows(pages: np.ndarray, length: int) -> torch.Tensor:
    """A pool's raw pages ``[pages, page_bytes]`` as fp32 rows ``[length, KV, D]``."""
    got = torch.frombuffer(bytearray(pages.tobytes()), dtype=torch.float32)
    return got.view(-1, KV_HEADS, HEAD_DIM)[:length]


def test_the_worker_sends_its_eagle3_draft_to_a_speculating_decode(
    latest: SglangDecodeProcess, tmp_path: Path
) -> None:
    target, draft = target_and_draft(tmp_path / "ckpt", "eagle3")
    k = test_eagle_draft.TOPK
    settings = ("model.draft=eagle3", f"model.draft_path={draft}", f"model.draft_topk={k}")
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
        torch.testing.assert_close(got_hidden, hidden, atol=1e-4, rtol=0)
        assert_pools_whole(served.worker)
    finally:
        client.close()
        served.worker.child.kill()
