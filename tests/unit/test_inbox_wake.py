"""The inbox's wake-up pipe: readable after a put or a wake until cleared, with at most one
byte pending however many messages arrive."""

from __future__ import annotations

import select

from prefill_worker.inbox import Inbox
from prefill_worker.request import AbortRequest


def is_readable(inbox: Inbox) -> bool:
    return bool(select.select([inbox.fileno()], [], [], 0)[0])


def test_puts_and_wakes_signal_once_until_cleared() -> None:
    inbox = Inbox()
    try:
        assert not is_readable(inbox)
        for i in range(100):
            inbox.put(AbortRequest(f"r{i}"))
        assert is_readable(inbox) and inbox.qsize() == 100
        inbox.clear_wake()  # reads at most 64 bytes: one was written, not 100
        assert not is_readable(inbox)
        inbox.put(AbortRequest("r100"))
        assert is_readable(inbox)
        inbox.clear_wake()
        assert not is_readable(inbox)
        inbox.wake()
        assert is_readable(inbox)
        inbox.clear_wake()
        assert not is_readable(inbox) and inbox.get_nowait() == AbortRequest("r0")
    finally:
        inbox.close()
