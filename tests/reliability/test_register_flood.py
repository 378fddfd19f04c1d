"""Registers at the page limit (issue #24, finding 2): forty native ``register``s with valid NIXL
metadata and ``num_pages`` at ``transfer.max_peer_pages``, each refused by NIXL because the
decode never registered that much memory. Before: each cost ~1 s and ~300 MB on the worker
(a [regions x pages] descriptor table, then NIXL building every descriptor) while the engine
waited; the engine stalled for tens of seconds and the legitimate decode was dropped as silent.

A real worker process, real ZMQ, real NIXL agents on the attacker's side."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import zmq

from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import RoomState, wire
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


NUM_BIG_REGISTERS = 400
BIG_METADATA_REGIONS = 40_000  # registered by the attacker's agent: 1.7 MB of NIXL metadata


def test_a_connection_flooding_big_registers_holds_bounded_memory(rig_factory) -> None:
    """One connection sends 400 registers of 1.7 MB faster than the engine reads them (at
    most 4 a turn); before, ZMQ queued them all in the worker (+750 MB). Now ZMQ stops reading
    that connection at its receive high-water mark, and the decode is served throughout."""
    rig: Rig = rig_factory()
    peer = RawPeer(rig.worker.bootstrap)
    try:
        buf = np.zeros(BIG_METADATA_REGIONS * 64, np.uint8)
        base = int(buf.ctypes.data)
        table = [[base + i * 64, 64, 0] for i in range(BIG_METADATA_REGIONS)]
        peer.agent.register_memory(np.array(table, dtype=np.uint64), "DRAM")
        register = at_limit_register(peer)
        peer.sock.setsockopt(zmq.SNDHWM, 0)
        watch = Watch(rig.worker)
        room = rig.next_room()
        rig.decode.want(room, 9)
        for _ in range(NUM_BIG_REGISTERS):
            peer.send(register)
        rid = rig.router.send_prefill(prompt(9, seed=7), room)
        assert rig.router.wait([rid], timeout_s=60.0)[rid].status is OutcomeStatus.OK
        replies = [peer.reply(timeout_s=60.0) for _ in range(NUM_BIG_REGISTERS)]
        watch.stop()
        assert all(isinstance(r, wire.Registered) and not r.is_ok for r in replies)
        assert rig.decode.wait([room])[room].state is RoomState.DONE
        rig.decode.release(room)
        print(f"\n{NUM_BIG_REGISTERS} registers of 1.7 MB on one connection: {watch.summary()}")
        assert watch.rss_growth_mib < 512, watch.summary()
    finally:
        peer.close()
    check_healthy(rig)
