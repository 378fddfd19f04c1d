"""``model.draft: mtp`` end to end on the native protocol: the real daemon on a tiny
DeepSeek-V3 with an MTP layer and a decode SDK that registers a draft pool and draft rows
beside its MLA pool (real NIXL). Per room the draft layer's latent rows land in the draft
pool's pages and the draft's first proposal (top-k probabilities and ids, hidden state) in
the room's draft row, equal to the reference written from the model's definition
(``test_mtp_draft.reference``) within 1e-4; the target's first token is transformers'. Two
prompts at once, one longer than a chunk. Pools whole after; the worker drains to exit 0."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import KVRegions
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import KVReceiver, RoomState, describe_worker
from prefill_worker.transfer.draft import DraftSide
from tests.checkpoints import hf_model, prompt, with_mtp_layer
from tests.integration.daemon.conftest import (
    DECODE_PAGES,
    Decode,
    decode_pool,
    prefill_claimed,
    start_worker,
    wait_until,
)
from tests.integration.daemon.test_hybrid_daemon import pools_whole
from tests.integration.model import test_mtp_draft
from tests.patience import patient

PROMPTS = {6101: 37, 6102: 11}  # room: prompt tokens (chunks are 16)
NUM_AUX_ROWS = 8


class DraftDecode(Decode):
    """An MLA decode with a one-layer draft pool (zeros) and draft rows."""

    def __init__(self, bootstrap: str, hidden_size: int) -> None:
        layout = describe_worker(bootstrap, 30.0)
        self.k, self.v = decode_pool(layout.kind, 1, layout.head_dim, layout.num_layers)
        (self.draft_k,), _ = decode_pool(layout.kind, 1, layout.head_dim, 1)
        self.rows = DraftRows(NUM_AUX_ROWS, hidden_size * 4)  # float32
        one = dataclasses.replace(layout, num_layers=1, num_pages=DECODE_PAGES)
        ptr = self.draft_k.data_ptr()
        regions = KVRegions(one, (ptr,), (), "cpu", self.rows.base_addr, NUM_AUX_ROWS)
        self.receiver = KVReceiver.from_tensors(
            self.k, self.v, bootstrap, num_aux_rows=NUM_AUX_ROWS,
            draft=DraftSide(regions, self.rows),
        )  # fmt: skip
        self.receiver.wait_registered(timeout_s=patient(30))
        self._next_page, self._next_slot, self.rooms = DECODE_PAGES - 1, 0, {}


def test_a_native_decode_receives_the_mtp_draft(tmp_path: Path) -> None:
    target = with_mtp_layer(tmp_path / "ckpt")
    settings = ("model.draft=mtp", f"model.draft_topk={test_mtp_draft.TOPK}", "cache.num_pages=64")
    worker = start_worker(tmp_path, target, *settings)
    try:
        worker.child.wait_ready(120)
        router = BlockingRouterClient(worker.ingress)
        hidden_size = json.loads((target / "config.json").read_text())["hidden_size"]
        decode = DraftDecode(worker.bootstrap, hidden_size)
        prompts = {room: prompt(n, seed=room) for room, n in PROMPTS.items()}
        statuses, results = prefill_claimed(router, decode, prompts)
        hf = (hf_model(target), hf_model(tmp_path / "ckpt" / "donor"))
        tensors = load_file(target / "model.safetensors")
        for room, ids in prompts.items():
            assert results[room].status is OutcomeStatus.OK, results[room]
            assert statuses[room].state is RoomState.DONE, statuses[room]
            first, topk_p, topk_index, hidden, rows = test_mtp_draft.reference(hf, tensors, ids)
            assert results[room].first_token_id == first
            pages, slot = decode.rooms[room]
            got = torch.cat([decode.draft_k[p] for p in pages])[: len(ids), 0]
            torch.testing.assert_close(got, rows, atol=1e-4, rtol=0)
            draft = decode.receiver.read_draft(slot)
            assert draft is not None and list(draft.topk_index) == topk_index.tolist()
            torch.testing.assert_close(torch.tensor(draft.topk_p), topk_p, atol=1e-4, rtol=0)
            got_hidden = torch.frombuffer(bytearray(draft.hidden), dtype=torch.float32)
            torch.testing.assert_close(got_hidden, hidden, atol=1e-4, rtol=0)
        decode.close()
        router.close()
        wait_until(lambda: pools_whole(worker), 30, "every aux row and page back")
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()
