"""The engine's inbox: a ``queue.Queue`` that also makes a file descriptor readable.

Producers (the ingress, the daemon) use it as any queue; each ``put`` (and ``wake()``) makes
``fileno()`` readable, so the engine can block on it together with the transfer backend's
socket instead of polling. The engine calls ``clear_wake()`` before it drains the queue: a
message put after that writes a fresh byte, so none is ever missed. ``EngineMessage`` is what
travels in it. Shared vocabulary: the ingress and the HTTP front put into it without importing
the scheduler.
"""

from __future__ import annotations

import os
import queue
from typing import Any

from prefill_worker.request import AbortRequest, PrefillRequest

EngineMessage = PrefillRequest | AbortRequest


class Inbox(queue.Queue[EngineMessage]):
    """An unbounded queue with a wake-up pipe (one byte at most is ever pending)."""

    def __init__(self) -> None:
        super().__init__()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._is_signalled = False

    def _put(self, item: Any) -> None:  # queue.Queue's hook, called holding its mutex
        super()._put(item)
        self._signal()

    def _signal(self) -> None:
        if not self._is_signalled:
            self._is_signalled = True
            os.write(self._write_fd, b"\0")

    def wake(self) -> None:
        """Make the engine look now (a stop flag was set, say) without a message."""
        with self.mutex:
            self._signal()

    def fileno(self) -> int:
        """Readable while a put or wake has not been cleared."""
        return self._read_fd

    def clear_wake(self) -> None:
        with self.mutex:
            if self._is_signalled:
                self._is_signalled = False
                os.read(self._read_fd, 64)

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)
