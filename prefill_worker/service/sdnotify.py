"""systemd's notify protocol (``Type=notify``): one datagram per message, no dependency.

``READY=1`` after start-up, ``STATUS=...`` on changes, ``WATCHDOG=1`` from the engine loop at
half the watchdog interval, ``STOPPING=1`` when draining begins. Without ``NOTIFY_SOCKET``
every call is a no-op. The daemon reads the two systemd variables once and passes them in.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


class SdNotifier:
    def __init__(
        self,
        socket_path: str | None,
        watchdog_usec: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._address = _address(socket_path) if socket_path else None
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
            )
        self._clock = clock
        self._watchdog_period_s = watchdog_usec / 2e6 if watchdog_usec else None
        self._last_watchdog = float("-inf")

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> SdNotifier:
        usec = env.get("WATCHDOG_USEC", "")
        return cls(env.get("NOTIFY_SOCKET"), int(usec) if usec.isdigit() else None)

    @property
    def is_enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> None:
        """Send ``KEY=value`` lines as one datagram; failures are logged, never raised."""
        if self._sock is None or self._address is None:
            return
        try:
            self._sock.sendto("\n".join(fields).encode(), self._address)
        except BlockingIOError:
            # The manager is not reading (its queue holds ~10): drop rather than stall the loop.
            log.debug("sd_notify queue full; dropped %s", fields[0])
        except OSError as exc:
            log.warning("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> None:
        """Call every loop turn; pings at most twice per watchdog interval."""
        if self._watchdog_period_s is None:
            return
        now = self._clock()
        if now - self._last_watchdog >= self._watchdog_period_s:
            self._last_watchdog = now
            self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _address(path: str) -> str:
    # "@name" is Linux's abstract namespace, spelled with a leading NUL byte.
    return "\0" + path[1:] if path.startswith("@") else path
