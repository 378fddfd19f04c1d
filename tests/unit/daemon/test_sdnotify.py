"""sd_notify datagrams arrive, in order, on a real unix datagram socket."""

from __future__ import annotations

import socket
from pathlib import Path

from prefill_worker.service.sdnotify import SdNotifier


def receiver(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    return sock, path


def test_messages_in_order(tmp_path: Path) -> None:
    sock, path = receiver(tmp_path)
    notifier = SdNotifier.from_environ({"NOTIFY_SOCKET": path})
    notifier.ready("serving")
    notifier.status("busy")
    notifier.stopping("draining")
    got = [sock.recv(4096).decode() for _ in range(3)]
    assert got == ["READY=1\nSTATUS=serving", "STATUS=busy", "STOPPING=1\nSTATUS=draining"]


def test_watchdog_rate_limited(tmp_path: Path) -> None:
    sock, path = receiver(tmp_path)
    now = [0.0]
    notifier = SdNotifier(path, watchdog_usec=2_000_000, clock=lambda: now[0])
    for t in (0.0, 0.5, 0.99, 1.0, 1.5, 2.1):
        now[0] = t
        notifier.watchdog()
    notifier.status("end")
    got = []
    while (msg := sock.recv(4096).decode()) != "STATUS=end":
        got.append(msg)
    assert got == ["WATCHDOG=1"] * 3  # at 0.0, 1.0 and 2.1: every half interval


def test_disabled_without_socket() -> None:
    notifier = SdNotifier.from_environ({})
    assert not notifier.is_enabled
    notifier.ready("x")
    notifier.watchdog()


def test_abstract_namespace() -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0prefill-worker-test-notify")
    sock.settimeout(2)
    SdNotifier("@prefill-worker-test-notify").ready("ok")
    assert sock.recv(4096) == b"READY=1\nSTATUS=ok"
