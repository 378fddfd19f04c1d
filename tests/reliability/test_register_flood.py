"""Registers at the page limit (issue #24, finding 2): forty native ``register``s with valid NIXL
metadata and ``num_pages`` at ``transfer.max_peer_pages``, each refused by NIXL because the
decode never registered that much memory. Before: each cost ~1 s and ~300 MB on the worker
(a [regions x pages] descriptor table, then NIXL building every descriptor) while the engine
waited; the engine stalled for tens of seconds and the legitimate decode was dropped as silent.

A real worker process, real ZMQ, real NIXL agents on the attacker's side."""

from __future__ import annotations

import dataclasses
import threading

from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import wire
from prefill_worker.transfer.receiver import RoomState
from prefill_worker.transfer.validate import DEFAULT_MAX_PEER_PAGES
from tests.checkpoints import prompt
from tests.reliability.conftest import Reply, Rig, check_healthy
from tests.reliability.test_bootstrap import LAYOUT, RawPeer
from tests.reliability.watch import Watch, sigterm_exit_s

NUM_ATTACKERS = 40


def at_limit_register(peer: RawPeer) -> wire.Register:
    big = dataclasses.replace(LAYOUT, num_pages=DEFAULT_MAX_PEER_PAGES)
    return peer.register_msg(layout=big, num_aux_rows=DEFAULT_MAX_PEER_PAGES)


def test_registers_at_the_page_limit_leave_the_decode_its_requests(rig_factory) -> None:
    rig: Rig = rig_factory()
    pid = rig.worker.proc.pid
    attackers = [RawPeer(rig.worker.bootstrap) for _ in range(NUM_ATTACKERS)]
    try:
        watch = Watch(rig.worker)
        rooms = [rig.next_room() for _ in range(4)]
        for room in rooms[:2]:
            rig.decode.want(room, 9)
        for peer in attackers:
            peer.send(at_limit_register(peer))
        outcomes: dict[str, object] = {}
        served = threading.Thread(target=lambda: outcomes.update(serve_during(rig, rooms)))
        served.start()
        replies = [peer.reply(timeout_s=120.0) for peer in attackers]
        served.join()
        watch.stop()
        assert len(outcomes) == len(rooms)
        assert all(r.status is OutcomeStatus.OK for r in outcomes.values()), outcomes  # type: ignore[attr-defined]
        assert all(isinstance(r, wire.Registered) and not r.is_ok for r in replies), replies[:3]
        assert all("NIXL" in (r.reason or "") for r in replies), replies[:3]  # type: ignore[union-attr]
        statuses = rig.decode.wait(rooms)
        assert all(s.state is RoomState.DONE for s in statuses.values()), statuses
        for room in rooms:
            rig.decode.release(room)
        assert "dropping decode peer" not in rig.worker.log()
        print(f"\n{NUM_ATTACKERS} at-limit registers: {watch.summary()}")
    finally:
        for peer in attackers:
            peer.close()
    check_healthy(rig)
    assert rig.worker.proc.pid == pid
    print(f"SIGTERM exit {sigterm_exit_s(rig.worker):.2f} s")


def serve_during(rig: Rig, rooms: list[int]) -> dict[str, Reply]:
    """The legitimate decode's requests while the registers arrive (two wanted before)."""
    for room in rooms[2:]:
        rig.decode.want(room, 9)
    rids = [rig.router.send_prefill(prompt(9, seed=room % 1000), room) for room in rooms]
    return rig.router.wait(rids, timeout_s=120.0)
