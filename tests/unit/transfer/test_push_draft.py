"""A draft beside the target in the push engine, against the scripted NIXL agent of
test_push_sender.py: a decode whose pool holds the draft's layers is written from the list of
our pool with them (``PushContext.draft_pages``; token runs of our heads of both into a
decode rank of another TP size), one without from the target's; the SGLang
dialect's metadata row for each pairing of a speculating or plain decode and a worker with
or without a draft (docs/models.md, "MTP draft")."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from prefill_worker.batch import DraftRow
from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.headplan import plan_rank, slice_indices
from prefill_worker.transfer.nixl.agent import PreppedLists
from prefill_worker.transfer.nixl.poster import InlinePoster
from prefill_worker.transfer.push.dialect import PageLists
from prefill_worker.transfer.push.hub import PushHub
from prefill_worker.transfer.push.refusals import ExpiringTable, Refusals, RejectCounter
from prefill_worker.transfer.push.sender import PushContext, PushSender
from prefill_worker.transfer.sglang import aux, frames
from prefill_worker.transfer.sglang.dialect import SglangDialect, SglangPeer
from tests.unit.transfer.test_push_sender import LAYOUT, REGIONS, Agent, FakeList, Heard, Sink

HIDDEN_BYTES = 12
DRAFT = DraftRow((0.5, 0.25), (17, 4), bytes(range(1, 13)))
WITH_DRAFT = dataclasses.replace(
    REGIONS,
    layout=dataclasses.replace(LAYOUT, num_layers=3),
    k_base_addrs=(*REGIONS.k_base_addrs, 24576),
    v_base_addrs=(*REGIONS.v_base_addrs, 28672),
)


class DraftRig:
    """A hub whose worker has a draft (``has_draft``) and one SGLang decode peer."""

    def __init__(self, has_draft: bool, peer_regions: Any, num_draft_entries: int) -> None:
        self.agent, self.heard, self.now = Agent(), Heard(), 100.0
        poster = InlinePoster(self.agent)
        pool = AuxPool(4)
        pool.buffer[1] = np.frombuffer(AuxRow(42, -0.5, 16, 0).pack(), np.uint8)
        self.staging = aux.AuxStaging(4)
        self.spec = aux.AuxStaging(4, aux.spec_row_dtype(HIDDEN_BYTES)) if has_draft else None
        rows = DraftRows(4, HIDDEN_BYTES) if has_draft else None
        if rows is not None:
            rows.write(1, DRAFT)
        view = aux.AuxRowsView(pool.base_addr, 4)
        self._pool = pool
        dialect = SglangDialect(
            Sink(self.heard.sglang), poster, self.staging, view, self.spec, rows
        )  # type: ignore[arg-type]
        head_bytes = LAYOUT.head_dim * LAYOUT.itemsize  # one head of one token
        pages = PageLists("kv", LAYOUT.num_regions, LAYOUT.region_page_bytes, head_bytes)
        both = PageLists("kv+draft", 6, LAYOUT.region_page_bytes, head_bytes) if has_draft else None
        self.ctx: PushContext[Any] = PushContext(
            poster, pages, LAYOUT, dialect, 5.0, lambda: self.now, draft_pages=both
        )
        refusals = Refusals(ExpiringTable(60.0, 8), ExpiringTable(5.0, 8))
        self.hub: PushHub[Any] = PushHub(
            self.ctx, self.agent, RejectCounter("test"), refusals, 5.0, 64
        )
        self.peer = SglangPeer(
            b"decode-1",
            "decode-1",
            peer_regions,
            PreppedLists(FakeList(), FakeList()),
            self.now,
            aux_ptrs=tuple(range(0x10000, 0x1A000, 0x1000)),
            endpoint=frames.Endpoint("127.0.0.1", 5555),
            num_draft_entries=num_draft_entries,
        )
        self.hub.peers[self.peer.identity] = self.peer

    def pushed(self) -> tuple[PushSender[Any], Any, Any]:
        """One room: a page, then aux row 1, everything landed: (sender, the page write's
        args, the aux write's args)."""
        sender = self.hub.create_sender(7, "req-7", 16)
        self.hub.want(self.peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
        sender.send_pages([9], 0)
        sender.send_aux(1)
        self.agent.handles[0].state = "DONE"
        sender.progress()
        self.agent.handles[1].state = "DONE"
        sender.progress()
        self.hub.drain()
        assert sender.poll() is KVPoll.SUCCESS, sender.failure_reason()
        return sender, self.agent.handles[0].args, self.agent.handles[1].args


def test_a_decode_holding_the_draft_is_written_the_draft_layer_with_the_target() -> None:
    rig = DraftRig(True, WITH_DRAFT, 2)
    sender, page, row = rig.pushed()
    _, local, local_idx, _, remote_idx, _ = page
    assert local == "kv+draft" and len(local_idx) == len(remote_idx) == 6  # K, V of 3 layers
    assert list(local_idx) == [9 + r * 16 for r in range(6)]
    _, local_descs, remote_descs, _ = row
    hidden = aux.AUX_BUFFER_NAMES.index("output_hidden_states")
    assert len(local_descs) == 10 and int(local_descs[hidden][1]) == HIDDEN_BYTES
    assert int(remote_descs[hidden][0]) == rig.peer.aux_ptrs[hidden] + 2 * HIDDEN_BYTES
    assert rig.spec is not None
    staged = rig.spec.rows[1]
    assert staged["output_topk_p"][:3].tolist() == [0.5, 0.25, 0.0]
    assert staged["output_topk_index"][:3].tolist() == [17, 4, 0]
    assert staged["output_hidden_states"].tobytes() == DRAFT.hidden
    assert staged["output_ids"][0] == 42 and staged["bootstrap_room"][0] == 7
    row_bytes = rig.spec.row_dtype.itemsize
    assert sender.transfer_stats().bytes == 6 * LAYOUT.region_page_bytes + row_bytes


@pytest.mark.parametrize("has_draft", [True, False])
def test_a_decode_without_a_draft_pool_is_written_the_target_and_the_default_row(
    has_draft: bool,
) -> None:
    rig = DraftRig(has_draft, REGIONS, 0)
    sender, page, row = rig.pushed()
    assert page[1] == "kv" and len(page[2]) == 4
    _, local_descs, _, _ = row
    assert [int(n) for n in local_descs[:, 1]] == list(aux.ITEM_BYTES)
    assert not rig.staging.rows[1]["output_topk_p"].any()
    assert sender.transfer_stats().bytes == 4 * LAYOUT.region_page_bytes + 1600


def test_a_worker_without_a_draft_leaves_a_speculating_decodes_hidden_row_alone() -> None:
    rig = DraftRig(False, REGIONS, 2)
    sender, page, row = rig.pushed()
    assert page[1] == "kv"
    _, local_descs, remote_descs, _ = row
    hidden = aux.AUX_BUFFER_NAMES.index("output_hidden_states")
    written = [i for i in range(10) if i != hidden]
    assert [int(n) for n in local_descs[:, 1]] == [aux.ITEM_BYTES[i] for i in written]
    expected = [rig.peer.aux_ptrs[i] + 2 * aux.ITEM_BYTES[i] for i in written]
    assert [int(a) for a in remote_descs[:, 0]] == expected
    assert sender.transfer_stats().bytes == 4 * LAYOUT.region_page_bytes + 1600 - 64


def test_a_decode_of_another_tp_size_gets_our_draft_heads_with_our_target_heads() -> None:
    """Rank 0 of a TP-2 worker (one of 2 KV heads) into a TP-1 decode holding the draft's
    layer: token runs of our head in the target's 2 layers and the draft's, from our token-run
    list of the pool with the draft's layers, at the decode's head 0."""
    (head_slice,) = plan_rank(2, 0, 2, 1)
    theirs = KVLayout(3, 2, 8, "float32", 4, 16)  # 2 target layers and the draft's, 2 heads
    regions = KVRegions(
        theirs, (1 << 20, 2 << 20, 3 << 20), (4 << 20, 5 << 20, 6 << 20), "cpu", 0, 4
    )
    rig = DraftRig(True, regions, 2)
    rig.peer.head_slice = head_slice
    assert rig.ctx.draft_pages is not None
    rig.ctx.pages.sliced[(0, 1)] = "kv runs"
    rig.ctx.draft_pages.sliced[(0, 1)] = "kv+draft runs"
    sender, page, _ = rig.pushed()
    _, local, local_idx, _, remote_idx, _ = page
    assert local == "kv+draft runs"
    assert len(local_idx) == len(remote_idx) == 2 * 3 * LAYOUT.page_size  # K, V of 3 layers
    assert list(local_idx) == list(slice_indices(np.array([9]), WITH_DRAFT.layout))
    assert list(remote_idx) == list(slice_indices(np.array([3]), theirs))
    assert rig.spec is not None
    run_bytes = LAYOUT.head_dim * LAYOUT.itemsize  # one head of one token
    assert sender.transfer_stats().bytes == len(local_idx) * run_bytes + rig.spec.row_dtype.itemsize
