"""A decode peer as a process of its own, for scenarios that kill or stop it.

``python -m tests.reliability.decode_process BOOTSTRAP ROOM:NUM_TOKENS ...`` registers a
``LiveDecode`` with the worker, wants each room, says READY=1 on ``NOTIFY_SOCKET`` and then
keeps its receiver going (heartbeats, NIXL notifications) until it is signalled, logging each
room as it settles.
"""

from __future__ import annotations

import os
import sys
import threading

from prefill_worker.service.sdnotify import SdNotifier
from prefill_worker.transfer import RoomState
from tests.reliability.harness import LiveDecode


def main(argv: list[str]) -> None:
    bootstrap, specs = argv[0], [spec.split(":") for spec in argv[1:]]
    decode = LiveDecode(bootstrap)
    rooms = {int(room): int(num_tokens) for room, num_tokens in specs}
    for room, num_tokens in rooms.items():
        decode.want(room, num_tokens)
    SdNotifier.from_environ(os.environ).ready(f"wanted {len(rooms)} rooms")
    pending, stop = set(rooms), threading.Event()
    while pending:
        for room in sorted(pending):
            status = decode.status(room)
            if status.state is not RoomState.PENDING:
                print(f"room {room}: {status.state.value} {status.reason}", flush=True)
                pending.discard(room)
        stop.wait(0.01)  # pacing of the status log; the pump thread does the work
    stop.wait()  # settled: stay registered until signalled


if __name__ == "__main__":
    main(sys.argv[1:])
