"""What a backend's hub is started with (``HubBackend._start_hub``, shared by the native and
SGLang backends): its refusals are counted under the backend's kind and told to
``hooks.on_reject``, and the options' want timeout and unmatched-want cap are the hub's."""

from __future__ import annotations

import logging

import msgspec
import pytest

from prefill_worker.transfer import wire
from prefill_worker.transfer.options import Hooks, NativeOptions, SglangOptions
from prefill_worker.transfer.push.hub import HubBackend
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.push.sender import Tell
from prefill_worker.transfer.validate import BootstrapLimits
from tests.unit.transfer.test_push_sender import Rig


class Backend(HubBackend[Peer]):
    def __init__(self, rig: Rig, kind: str, options: NativeOptions | SglangOptions) -> None:
        self.told: list[str] = []
        hooks = Hooks(on_reject=self.told.append)
        self.hub = self._start_hub(rig.ctx, rig.agent, rig.refusals, kind, options, hooks)


def options(kind: str, want_timeout_s: float, max_unmatched: int) -> NativeOptions | SglangOptions:
    limits = BootstrapLimits(max_unmatched_wants=max_unmatched)
    if kind == "bootstrap":
        return NativeOptions("tcp://127.0.0.1:0", 5.0, 1.0, want_timeout_s, limits=limits)
    return SglangOptions("127.0.0.1:0", "127.0.0.1", 0, "auto", 5.0, want_timeout_s, limits=limits)


@pytest.mark.parametrize(("dialect", "kind"), [("native", "bootstrap"), ("sglang", "sglang")])
def test_the_hub_gets_the_backends_options_and_counts_under_its_kind(
    dialect: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(dialect)
    backend = Backend(rig, kind, options(kind, 7.5, 2))
    hub = backend.hub
    assert hub.ctx is rig.ctx and hub.refusals is rig.refusals
    assert hub.want_timeout_s == 7.5 and hub.counter.protocol == kind
    hub.peers[rig.peer.identity] = rig.peer
    with caplog.at_level(logging.DEBUG, logger="prefill_worker.transfer.push.refusals"):
        for room in (101, 102, 103):  # no request yet: each want waits; the third is too many
            hub.want(rig.peer, wire.Want.of(room, [3], 0, 0))
    assert hub.rooms.num_claims(101) == 1 and hub.rooms.num_claims(102) == 1
    assert hub.rooms.num_claims(103) == 0
    assert backend.reject_counts == {"too_many_wants": 1} and backend.told == ["too_many_wants"]
    assert f"{kind}: too_many_wants" in caplog.text
    hub.drop_peer(rig.peer, "gone")  # its agent is forgotten on the backend's own agent
    assert rig.agent.forgotten == [rig.peer.agent_name]


def test_the_backend_hands_the_requests_traceparent_to_its_sender() -> None:
    """For the decode's trace: what the engine gives ``create_sender`` is what the push
    sender tells in its statuses (docs/observability.md)."""
    rig = Rig("native")
    backend = Backend(rig, "bootstrap", options("bootstrap", 7.5, 2))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = backend.create_sender(7, "req-7", 16, traceparent=parent)
    plain = backend.create_sender(8, "req-8", 16)
    for sender, room in ((traced, 7), (plain, 8)):
        backend.hub.want(rig.peer, wire.Want.of(room, [3, 4, 5, 6], 2, 0))
        sender.fail("boom")
    told = {e.status.room: e.status for e in rig.ctx.events if isinstance(e, Tell)}
    assert told[7].traceparent == parent
    assert told[8].traceparent is msgspec.UNSET


def test_the_backend_names_each_room_a_want_bound_once() -> None:
    """``take_claimed_rooms``: what the engine polls first (#40 finding 4)."""
    rig = Rig("native")
    backend = Backend(rig, "bootstrap", options("bootstrap", 7.5, 4))
    backend.hub.peers[rig.peer.identity] = rig.peer
    first, second = backend.create_sender(7, "req-7", 16), backend.create_sender(8, "req-8", 16)
    assert backend.take_claimed_rooms() == []
    backend.hub.want(rig.peer, wire.Want.of(8, [3, 4, 5, 6], 2, 0))
    backend.hub.want(rig.peer, wire.Want.of(9, [3, 4, 5, 6], 2, 0))  # no request yet: waits
    assert backend.take_claimed_rooms() == [8]
    assert backend.take_claimed_rooms() == []  # each once
    backend.create_sender(9, "req-9", 16)  # bound as it is created
    backend.hub.want(rig.peer, wire.Want.of(7, [3, 4, 5, 6], 2, 0))
    assert backend.take_claimed_rooms() == [9, 7]
    for sender in (first, second):
        sender.fail("done")
