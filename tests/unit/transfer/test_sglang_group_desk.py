"""The leader of a TP-2 worker answering SGLang decodes for its group (docs/sglang.md,
"Workers with TP > 1"): ``/route`` names the group's size and the leader's control socket for
each rank; each decode rank is written rank 0's heads here, its registration kept as a native
`register` for the mirror; a decode of TP 1 asks both ranks (two copies of each request, two
``KV_STATUS`` expected), one of TP 2 asks its own rank."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.headplan import slice_table
from prefill_worker.transfer.sglang.accept import server_info
from prefill_worker.transfer.sglang.bootstrap_http import BootstrapHttp
from prefill_worker.transfer.sglang.frames import AbortNotice, Endpoint, TransferRequest, parse
from tests.unit.transfer.test_mla import OURS as MLA_LAYOUT
from tests.unit.transfer.test_mla import mla_registration
from tests.unit.transfer.test_sglang_desk import (
    LAYOUT,
    FakeList,
    Rig,
    frames_of,
    registration,
)

# Rank 0's pool: one of the model's two KV heads (fake addresses: NIXL is a stand-in).
LOCAL = KVRegions(
    dataclasses.replace(LAYOUT, num_kv_heads=1), (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cpu", 0, 0
)


def leader() -> Rig:
    """Built as the backend builds it: over rank 0's pool (one head), then told the model's."""
    rig = Rig(regions=LOCAL, layout=LOCAL.layout)
    rig.desk.lead(2, LAYOUT.num_kv_heads)
    return rig


def request(**changes: object) -> TransferRequest:
    req = parse(frames_of("request"))
    assert isinstance(req, TransferRequest) and req.required_dst_info_num == 1
    return dataclasses.replace(req, **changes)  # type: ignore[arg-type]


def test_a_tp1_decode_gets_rank_0s_head_here_and_the_rest_from_the_mirror() -> None:
    rig, reg = leader(), registration()
    rig.send(reg)
    peer = rig.peers[reg.agent_name]
    assert peer.is_fed and peer.head_slice is not None
    assert (peer.head_slice.dst_head_offset, peer.head_slice.num_heads) == (0, 1)
    assert peer.registration is not None and peer.registration.regions == peer.regions
    assert peer.registration.tp == wire.DecodeRank(0, 1, 0, 2)
    assert peer.prefill_ranks == range(2)  # it asks both ranks
    rig.send(request())
    rig.send(request())  # the copy for rank 1 reaches this leader too: nothing changes
    assert rig.rooms.num_claims(1234) == 1 and not rig.rejects and not rig.replies.sent
    assert rig.hub.ctx.dialect.send(peer, wire.Status(1234, "ok", None))
    statuses = [frames[:4] for _, frames in rig.replies.sent]
    assert statuses == [[b"KV_STATUS", b"1234", b"4", rank] for rank in (b"0", b"1")]
    rig.replies.sent.clear()  # an ABORT_ACK too comes from each rank it asked
    assert rig.hub.ctx.dialect.send(peer, wire.Status(1234, "aborted", None), 3)
    acks = [frames for _, frames in rig.replies.sent]
    assert acks == [[b"ABORT_ACK", b"1234", rank, b"3"] for rank in (b"0", b"1")]


def test_a_tp2_decode_rank_1_is_written_by_rank_1_only() -> None:
    rig = leader()
    half = LAYOUT.page_bytes // 2
    reg = dataclasses.replace(
        registration(), tp_size=2, tp_rank=1, kv_item_len=half, kv_item_lens=(half,) * 4
    )
    rig.send(reg)
    peer = rig.peers[reg.agent_name]
    assert not peer.is_fed and peer.prefill_ranks == range(1, 2)
    assert (peer.tp_rank, peer.tp_size) == (1, 2)
    assert peer.registration is not None and peer.registration.tp == wire.DecodeRank(1, 2, 1, 2)
    rig.send(request())  # one decode rank per worker rank: required_dst_info_num 1
    assert rig.rooms.num_claims(1234) == 1 and not rig.rejects and not rig.replies.sent
    rig.send(request(room=99, required_dst_info_num=2))
    assert rig.rejects == ["unsupported"]


def test_the_mirrors_register_is_the_decodes_own_agent_metadata_and_pool() -> None:
    rig, reg = leader(), registration()
    rig.send(reg)
    held = rig.peers[reg.agent_name].registration
    assert held is not None
    want = wire.Register.of(
        reg.agent_name,
        wire.frame_metadata(reg.agent_metadata),
        rig.peers[reg.agent_name].regions,
        "sglang",
        wire.DecodeRank(0, 1, 0, 2),
    )
    assert held == want


def test_rank_0s_head_is_prepared_as_token_runs_once_for_every_decode_fed_that_slice() -> None:
    """A decode of TP 1 holds both heads; rank 0 writes its one at offset 0: token runs of
    head 0 on both sides, our side's list prepared once and kept for the next such decode."""
    rig, preps = leader(), []

    def prep(name: str, table: np.ndarray, mem_type: str) -> FakeList:
        preps.append((name, np.array(table)))
        return FakeList()

    rig.agent.prep_xfer_dlist = prep  # type: ignore[method-assign]
    first = registration()
    rig.send(first)
    second = dataclasses.replace(
        registration("other"), endpoint=Endpoint(first.endpoint.host, first.endpoint.port + 1)
    )
    rig.send(second)
    assert not rig.rejects and len(rig.peers) == 2
    names = [name for name, _ in preps]
    assert names[:3] == ["NIXL_INIT_AGENT", first.agent_name, first.agent_name]
    assert names[3:] == [second.agent_name] * 2  # ours is not prepared again
    assert np.array_equal(preps[0][1], slice_table(LOCAL, 0, 1))
    theirs = rig.peers[first.agent_name].regions
    assert np.array_equal(preps[1][1], slice_table(theirs, 0, 1))
    assert list(rig.hub.ctx.pages.sliced) == [(0, 1)]
    assert rig.hub.ctx.pages.sliced[(0, 1)] is not None


def test_a_copy_of_a_request_is_ignored_once_its_room_is_bound() -> None:
    """A decode of TP 1 sends each request to both ranks (both this leader): the copy that
    comes after the router's request bound the room changes nothing either."""
    rig, reg = leader(), registration()
    rig.send(reg)
    rig.send(request())
    sender = rig.hub.create_sender(1234, "req", 8)
    assert rig.peers[reg.agent_name] in sender.peers
    rig.send(request())
    assert not rig.rejects and not rig.replies.sent


def test_a_decode_of_the_workers_tp_asking_twice_is_refused_the_second_time() -> None:
    """Only a decode of smaller TP sends copies; one of the worker's TP (1 here) asking
    twice for a room is a duplicate."""
    rig = Rig()
    rig.send(registration())
    rig.send(request())
    rig.send(request())
    assert rig.rejects == ["duplicate_want"] and rig.rooms.num_claims(1234) == 1


def mla_leader() -> Rig:
    rig = Rig(layout=MLA_LAYOUT)
    rig.desk.lead(2, 1)
    return rig


DUMMY = {"is_dummy": True, "packed_page_ids": b""}  # SGLang's dummy: no pages


def statuses(rig: Rig) -> list[list[bytes]]:
    return [frames[:4] for _, frames in rig.replies.sent]


@pytest.mark.parametrize("dummy_first", [False, True], ids=["real-first", "dummy-first"])
def test_an_sglang_mla_decode_reads_the_latent_from_rank_0_and_dummies_rank_1(
    dummy_first: bool,
) -> None:
    """SGLang's MLA decode of attention TP 1 at a TP-2 worker: its real request for rank 0,
    a dummy for rank 1 (both reach the leader, in either order). The leader writes the latent
    whole (headplan: decode rank 0 from worker rank 0), the dummy holds nothing and hears
    nothing, and the decode gets one KV_STATUS, rank 0's (it counts one: a second would be
    a dummy rank speaking, which SGLang's never does)."""
    rig, reg = mla_leader(), mla_registration()
    rig.send(reg)
    rig.send(reg)  # registered once per rank it asks: the repeat changes nothing
    peer = rig.peers[reg.agent_name]
    assert peer.is_fed and peer.head_slice is None  # whole pages, no token runs
    assert peer.registration is not None and peer.registration.tp == wire.DecodeRank(0, 1, 0, 1)
    assert (peer.prefill_ranks, peer.status_ranks) == (range(2), range(1))
    for frame in [request(**DUMMY), request()][:: 1 if dummy_first else -1]:
        rig.send(frame)
    assert rig.rooms.num_claims(1234) == 1 and not rig.rejects and not rig.replies.sent
    assert rig.hub.ctx.dialect.send(peer, wire.Status(1234, "ok", None))
    assert statuses(rig) == [[b"KV_STATUS", b"1234", b"4", b"0"]]
    rig.replies.sent.clear()
    assert rig.hub.ctx.dialect.send(peer, wire.Status(1234, "failed", "lost"))
    failed = [b"KV_STATUS", b"1234", b"0", b"0", b"lost"]
    assert [frames for _, frames in rig.replies.sent] == [failed]


def test_a_dummy_alone_holds_nothing_and_hears_nothing() -> None:
    """The dummy for a room whose real request never came (or was refused): no want, no
    room, no reply; the real request is what fails or times out."""
    rig = mla_leader()
    rig.send(mla_registration())
    rig.send(request(**DUMMY))
    assert rig.rooms.num_claims(1234) == 0 and not rig.rejects and not rig.replies.sent
    too_many = bytes(4 * (MLA_LAYOUT.num_pages + 1))  # more pages than any prompt needs
    rig.send(request(room=77, packed_page_ids=too_many))
    rig.send(request(room=77, **DUMMY))
    assert rig.rejects == ["bad_want"] and rig.rooms.num_claims(77) == 0  # the real one's
    assert [frames[:4] for _, frames in rig.replies.sent] == [[b"KV_STATUS", b"77", b"0", b"0"]]


def test_an_mla_decodes_abort_is_acknowledged_in_the_name_of_both_ranks_it_asked() -> None:
    """It sends its ABORT to both ranks (both the leader) and frees the room's pages once an
    ABORT_ACK came from each rank it asked, the dummy's too (``is_abort_release_safe``)."""
    rig = mla_leader()
    reg = mla_registration()
    rig.send(reg)
    rig.send(request())
    rig.send(request(**DUMMY))
    for _ in range(2):
        rig.send(AbortNotice(1234, reg.endpoint, generation=5))
    assert rig.rooms.num_claims(1234) == 0
    acks = {tuple(frames) for _, frames in rig.replies.sent}
    assert acks == {(b"ABORT_ACK", b"1234", rank, b"5") for rank in (b"0", b"1")}


def test_dummies_are_refused_where_sglang_sends_none() -> None:
    """A K/V decode never sends one (every rank it asks is real), nor an MLA decode at a
    worker of its own TP: typed, named, the room's statuses failed."""
    mha = leader()
    mha.send(registration())
    mha.send(request(**DUMMY))
    single = Rig(layout=MLA_LAYOUT)
    single.send(mla_registration())
    single.send(request(**DUMMY))
    for rig, shape, ranks in [(mha, "attention TP 2, K/V", 2), (single, "attention TP 1, MLA", 1)]:
        assert rig.rejects == ["unsupported"] and rig.rooms.num_claims(1234) == 0
        sent = [frames for _, frames in rig.replies.sent]
        assert [f[:3] for f in sent] == [[b"KV_STATUS", b"1234", b"0"]] * ranks
        why = f"a dummy request (no pages) from a decode of attention TP 1 to this worker ({shape})"
        assert why in sent[0][4].decode()


@pytest.fixture
def routes() -> Iterator[BootstrapHttp]:
    http = BootstrapHttp("127.0.0.1:0", server_info(4, "auto"), {"rank_port": 7}, lambda: True)
    http.start()
    yield http
    http.stop()


def _route(http: BootstrapHttp, tp_rank: int, rank: int = 0) -> tuple[int, object]:
    query = f"prefill_dp_rank={rank}&prefill_cp_rank={rank}&target_pp_rank={rank}"
    url = f"http://{http.address}/route?{query}&target_tp_rank={tp_rank}"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_route_names_the_group_and_the_leaders_socket_for_each_rank(routes: BootstrapHttp) -> None:
    routes.lead(server_info(4, "auto", 2), 2)
    status, info = _route(routes, -1, -1)
    assert status == 200 and isinstance(info, dict) and info["attn_tp_size"] == 2
    assert [_route(routes, r) for r in (0, 1)] == [(200, {"rank_port": 7})] * 2
    assert _route(routes, 2)[0] == 404
    assert _route(routes, 0, 1)[0] == 404  # DP, CP and PP are 1


def test_an_mla_decode_of_attention_tp_2_is_served_at_tp_1_and_2_and_refused_at_4() -> None:
    """Each rank of SGLang's MLA decode of attention TP 2 holds the whole latent (docs/sglang.md,
    "An MLA decode of attention TP > 1"). A TP-1 worker takes rank 1 as a peer written the
    whole latent (whole pages), asking rank 0 with ``required_dst_info_num`` 2; a TP-2 leader
    leaves it to worker rank 1 (the headplan's) and binds its request needing 1; a TP-4
    leader refuses its registration, typed."""
    single, reg = Rig(layout=MLA_LAYOUT), mla_registration(tp_size=2, tp_rank=1)
    single.send(reg)
    peer = single.peers[reg.agent_name]
    assert peer.is_fed and peer.head_slice is None and peer.registration is None
    assert (peer.tp_rank, peer.tp_size) == (1, 2)
    assert (peer.prefill_ranks, peer.status_ranks) == (range(1), range(1))
    single.send(request(required_dst_info_num=2))
    assert single.rooms.num_claims(1234) == 1 and not single.rejects
    lead = mla_leader()
    lead.send(reg)
    peer = lead.peers[reg.agent_name]
    assert not peer.is_fed and peer.registration is not None
    assert peer.registration.tp == wire.DecodeRank(1, 2, 0, 1)
    assert (peer.prefill_ranks, peer.status_ranks) == (range(1, 2), range(1, 2))
    lead.send(request())
    assert lead.rooms.num_claims(1234) == 1 and not lead.rejects
    wide = Rig(layout=MLA_LAYOUT)
    wide.desk.lead(4, 1)
    wide.send(reg)
    assert wide.rejects == ["unsupported"] and reg.agent_name not in wide.peers


def test_an_attention_dp_worker_names_each_ranks_socket_and_answers_room_queries(
    routes: BootstrapHttp,
) -> None:
    """``prefill_port_table[dp_group]`` as SGLang 0.5.23's decode fills it from ``/route``,
    and ``/query_dp_ranks`` from the rooms rank 0 placed (docs/parallelism.md)."""
    placed = {10: 0, 11: 1}
    infos: list[dict[str, object]] = [{"rank_port": 7}, {"rank_port": 9}]
    routes.lead_dp(server_info(4, "auto", dp_size=2), infos, lambda rooms: {
        str(room): placed[room] for room in rooms if room in placed
    })  # fmt: skip
    status, info = _route(routes, -1, -1)
    assert status == 200 and isinstance(info, dict)
    assert info["dp_size"] == 2 and info["follow_bootstrap_room"] is True
    assert _route(routes, 0, 0) == (200, {"rank_port": 7})
    url = f"http://{routes.address}/route?prefill_dp_rank=1&prefill_cp_rank=0"
    with urllib.request.urlopen(f"{url}&target_pp_rank=0&target_tp_rank=0", timeout=5) as reply:
        assert json.loads(reply.read()) == {"rank_port": 9}
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(url.replace("dp_rank=1", "dp_rank=2") + "&target_pp_rank=0"
                               "&target_tp_rank=0", timeout=5)  # fmt: skip
    assert missing.value.code == 404
    ask = urllib.request.Request(
        f"http://{routes.address}/query_dp_ranks",
        data=json.dumps({"bootstrap_rooms": [11, 10, 12]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(ask, timeout=5) as reply:
        assert json.loads(reply.read()) == {"11": 1, "10": 0}
    bad = urllib.request.Request(ask.full_url, data=b'{"bootstrap_rooms": "x"}')
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=5)
    assert refused.value.code == 400
