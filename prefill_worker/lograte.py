"""Log lines a peer can provoke, at most one per interval per call site.

A peer that sends a stream of bad messages must not turn each into a log line (disk, and the
operator's attention): the counter in /metrics counts every one; the log says the first, then
at most one line per ``interval_s`` with how many were left out since::

    _BAD = RateLimitedLog(log, 10.0)
    _BAD.warning(now, "vllm: notification ignored: %s", exc)
"""

from __future__ import annotations

import logging


class RateLimitedLog:
    """One call site's lines; ``now`` is the caller's monotonic clock (one thread)."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger, self._interval_s = logger, interval_s
        self._next_at = float("-inf")
        self.num_suppressed = 0  # left out since the last line

    def warning(self, now: float, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at WARNING unless a line went out less than ``interval_s``
        ago; whether it was logged."""
        if now < self._next_at:
            self.num_suppressed += 1
            return False
        if self.num_suppressed:
            msg += f" ({self.num_suppressed} more like it not logged)"
        self._logger.warning(msg, *args)
        self._next_at, self.num_suppressed = now + self._interval_s, 0
        return True
