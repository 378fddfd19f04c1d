"""A paged state component on the native push (a DSA model's index keys): each chunk's pages of
it go with the chunk's KV pages, into the same decode pages of the decode's own pool of it, one
write per chunk; nothing is written for it at the end (no slot), so the aux row follows the
pages directly; a decode rank whose KV another rank of a TP group writes gets them too. A
want naming a state slot, or pages the decode's pool of it lacks, is refused
before a byte is written. Against the scripted agent of ``test_push_sender``."""

from __future__ import annotations

import dataclasses

import pytest
from msgspec import UNSET

from prefill_worker.kv.state_layout import (
    EACH_CHUNK,
    PAGES,
    StateComponent,
    StateRegions,
    StateTensor,
)
from prefill_worker.transfer import wire
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.nixl.state_lists import StateLists
from prefill_worker.transfer.pagemap import check_want_state
from tests.unit.transfer.test_push_sender import PAGE_RUN_BYTES, Rig

INDEX_K = StateTensor("index_k", (4, 24), "float32", 384)  # one page of one layer
COMPONENT = StateComponent("index_keys", (0, 1, 2), (INDEX_K,), 10, PAGES, EACH_CHUNK)
WORKER = StateRegions(COMPONENT, ((1000, 2000, 3000),), "cpu")  # 10 worker pages
DECODE = StateRegions(dataclasses.replace(COMPONENT, num_items=16), ((10, 20, 30),), "cpu")


@pytest.fixture
def rig() -> Rig:
    rig = Rig("native")
    rig.ctx = dataclasses.replace(rig.ctx, state=StateLists(WORKER, "index"))
    rig.hub.ctx = rig.ctx
    rig.peer.state = StateLists(DECODE, "decode-index")
    return rig


def bind(rig: Rig, pages: list[int], cached: int = 0, slot: int | object = UNSET):  # type: ignore[no-untyped-def]
    sender = rig.hub.create_sender(7, "req-7", 16)
    rig.hub.want(rig.peer, wire.Want.of(7, pages, 2, cached, slot))  # type: ignore[arg-type]
    return sender


def test_each_chunk_writes_its_index_pages_into_the_decode_pages_of_its_kv(rig: Rig) -> None:
    sender = bind(rig, [3, 4, 5, 6])
    assert sender.poll() is KVPoll.READY
    sender.send_pages([8, 1], 0)
    [kv, index] = rig.agent.handles
    assert kv.args[1] == "kv"  # the chunk's K/V pages first
    _, local, local_idx, remote, remote_idx, notif = index.args
    assert (local, remote, notif) == ("index", "decode-index", b"")
    # run (layer) after run: page p of the worker's 10, page d of the decode's 16
    assert list(local_idx) == [8, 1, 18, 11, 28, 21]
    assert list(remote_idx) == [3, 4, 19, 20, 35, 36]
    sender.send_pages([2, 9], 2)
    [*_, second] = rig.agent.handles
    assert list(second.args[2]) == [2, 9, 12, 19, 22, 29]
    assert list(second.args[4]) == [5, 6, 21, 22, 37, 38]
    for i in range(4):
        rig.land(i)
    sender.send_aux(1)
    sender.progress()
    assert len(rig.agent.handles) == 5  # the aux row next: no slot state to write
    assert rig.agent.handles[4].args[1] == "aux"
    # two chunks of 2 pages: K/V of 2 layers (512 bytes a page), index keys of 3 layers
    assert sender.transfer_stats().bytes == 2 * 2 * (PAGE_RUN_BYTES + 3 * 384)


def test_a_decode_rank_another_rank_feeds_still_gets_the_index_pages(rig: Rig) -> None:
    """A TP group's leader whose head plan leaves a decode rank's KV to a follower (an MLA
    decode rank of attention TP 2: its latent from worker rank 1) writes it the index pages
    all the same: every rank of ours holds the same keys, and only the leader sends them."""
    rig.peer.is_fed = False
    sender = bind(rig, [3, 4, 5, 6])
    sender.send_pages([8, 1], 0)
    [index] = rig.agent.handles  # no K/V write: only the index pages
    assert (index.args[1], index.args[3]) == ("index", "decode-index")
    assert list(index.args[4]) == [3, 4, 19, 20, 35, 36]


def test_a_decode_prefix_skips_its_index_pages_as_its_kv_pages(rig: Rig) -> None:
    sender = bind(rig, [5, 6], cached=8)  # the decode holds the first 2 pages
    sender.send_pages([8, 1, 2, 9], 0)
    [_, index] = rig.agent.handles
    assert list(index.args[2]) == [2, 9, 12, 19, 22, 29]
    assert list(index.args[4]) == [5, 6, 21, 22, 37, 38]


def test_a_want_naming_a_state_slot_is_refused() -> None:
    want = wire.Want.of(7, [3, 4, 5, 6], 2, 0, 1)
    why = check_want_state(want, COMPONENT, DECODE)
    assert why == "dst_state_slot: a paged state component lands in dst_page_ids, not a slot"


def test_pages_beyond_the_decode_index_pool_are_refused() -> None:
    small = StateRegions(dataclasses.replace(COMPONENT, num_items=6), ((10, 20, 30),), "cpu")
    assert check_want_state(wire.Want.of(7, [3, 4, 5], 2, 0), COMPONENT, small) is None
    why = check_want_state(wire.Want.of(7, [3, 4, 5, 6], 2, 0), COMPONENT, small)
    assert why == "dst_page_ids outside the decode's state pool of 6 pages"


def test_a_refused_want_gets_no_byte(rig: Rig) -> None:
    sender = bind(rig, [3, 4, 5, 6], slot=0)
    assert sender.poll() is KVPoll.FAILED
    assert "lands in dst_page_ids" in str(sender.failure_reason())
    assert not rig.agent.handles
