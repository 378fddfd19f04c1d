"""What an attack costs the worker, seen from outside: the worst ping round trip of a router
on the ingress and the peak resident memory of the worker process while it lasts, and how long
SIGTERM takes afterwards. Readings for docs/reliability.md, printed by the scenarios."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

from tests.reliability.harness import Ledger, ProcStats, Router, Worker

_PING_EVERY_S = 0.02  # pacing of the probes, not synchronisation
_RSS_EVERY_S = 0.01


@dataclass
class Watch:
    """Started before an attack, ``stop``ped after it: worst ping and peak RSS meanwhile."""

    worker: Worker
    rss_before_kib: int = 0
    rss_peak_kib: int = 0
    worst_ping_s: float = 0.0
    num_pings: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rss_before_kib = self.rss_peak_kib = ProcStats.of(self.worker.proc.pid).rss_kib
        self._router = Router(self.worker.ingress, Ledger())
        for target in (self._ping, self._sample_rss):
            self._threads.append(threading.Thread(target=target, daemon=True))
            self._threads[-1].start()

    def stop(self) -> Watch:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._router.close()
        return self

    @property
    def rss_growth_mib(self) -> float:
        return (self.rss_peak_kib - self.rss_before_kib) / 1024

    def summary(self) -> str:
        return (
            f"worst ping {self.worst_ping_s * 1000:.0f} ms over {self.num_pings} pings; "
            f"RSS {self.rss_before_kib / 1024:.0f} MiB, peak +{self.rss_growth_mib:.0f} MiB"
        )

    def _ping(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self._router.ping(timeout_s=120.0)
            self.worst_ping_s = max(self.worst_ping_s, time.monotonic() - start)
            self.num_pings += 1
            self._stop.wait(_PING_EVERY_S)

    def _sample_rss(self) -> None:
        pid = self.worker.proc.pid
        while not self._stop.is_set():
            self.rss_peak_kib = max(self.rss_peak_kib, ProcStats.of(pid).rss_kib)
            self._stop.wait(_RSS_EVERY_S)


def sigterm_exit_s(worker: Worker, timeout_s: float = 60.0) -> float:
    """SIGTERM the worker; seconds until it exited (fails past ``timeout_s``)."""
    start = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    worker.wait_exit(timeout_s)
    return time.monotonic() - start
