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

import pytest

from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.sglang.accept import server_info
from prefill_worker.transfer.sglang.bootstrap_http import BootstrapHttp
from prefill_worker.transfer.sglang.frames import TransferRequest, parse
from tests.unit.transfer.test_mla import OURS as MLA_LAYOUT
from tests.unit.transfer.test_mla import mla_registration
from tests.unit.transfer.test_sglang_desk import LAYOUT, Rig, frames_of, registration

# Rank 0's pool: one of the model's two KV heads (fake addresses: NIXL is a stand-in).
LOCAL = KVRegions(
    dataclasses.replace(LAYOUT, num_kv_heads=1), (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cpu", 0, 0
)


def leader() -> Rig:
    rig = Rig(regions=LOCAL)
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


def test_a_tp2_decode_rank_1_is_written_by_rank_1_only() -> None:
    rig = leader()
    half = LAYOUT.page_bytes // 2
    reg = dataclasses.replace(
        registration(), tp_size=2, tp_rank=1, kv_item_len=half, kv_item_lens=(half,) * 4
    )
    rig.send(reg)
    peer = rig.peers[reg.agent_name]
    assert not peer.is_fed and peer.prefill_ranks == range(1, 2)
    assert peer.registration is not None and peer.registration.tp == wire.DecodeRank(1, 2, 1, 2)
    rig.send(request())  # one decode rank per worker rank: required_dst_info_num 1
    assert rig.rooms.num_claims(1234) == 1 and not rig.rejects and not rig.replies.sent
    rig.send(request(room=99, required_dst_info_num=2))
    assert rig.rejects == ["unsupported"]


def test_an_sglang_mla_decode_is_refused_by_an_mla_worker_of_tp_2(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang's MLA decode (attention TP 1) asks every prefill rank, all but one with a dummy
    request; the desk does not serve that, so it refuses the registration, typed and named
    (the same decode is a peer of a TP-1 worker: test_mla.py). The native protocol serves
    such a worker (tests/integration/daemon/test_mla_tp.py)."""
    rig = Rig(layout=MLA_LAYOUT)
    rig.desk.lead(2, 1)
    rig.send(mla_registration())
    assert rig.rejects == ["unsupported"] and not rig.peers
    assert "an MLA model at worker TP 2: run the worker at TP 1" in caplog.text


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
