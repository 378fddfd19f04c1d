"""One sender's writes (``poster.Write``): those in flight, each with its deadline, and those
released but not yet settled::

    add ─▶ in flight ──check: DONE──▶ counted (``stats``, preparation time), released
                     ──check: ERR───▶ released, the reason returned
                     ──release_all──▶ released (NIXL cancels it)
    released, not settled yet ─▶ kept until it settles: ``pending()`` lists it, so a
                                 status waits for it (no byte may land after the decode
                                 hears ``failed``); ``unsettled()`` hands it to the reaper
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_worker.request import TransferStats
from prefill_worker.transfer.nixl.poster import Write


@dataclass(slots=True)
class _InFlight:
    write: Write
    deadline: float


class WriteSet:
    """Tracks writes; never blocks and never talks to NIXL except through ``Write``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # a write still in flight this long fails its request
        self._inflight: list[_InFlight] = []
        self._unsettled: list[Write] = []
        self.written_bytes = 0  # what landed
        self.num_writes = 0  # ... in how many of this agent's transfer requests
        self.num_descs = 0  # ... of how many descriptors
        self._telemetry: tuple[float, float] | None = None  # NIXL's (post, transfer) s, summed
        self.prep_s = 0.0  # building the finished writes' transfer requests
        self.prep_cpu_s = 0.0  # the same in CPU time of the threads that did it

    def __len__(self) -> int:
        """Writes in flight."""
        return len(self._inflight)

    def add(self, write: Write, now: float) -> None:
        self._inflight.append(_InFlight(write, now + self.timeout_s))

    def check(self, now: float) -> str | None:
        """Finished writes leave (those DONE counted); the first reason to fail the request:
        a write that failed, or one still in flight past its deadline (it stays, to be
        released with the others)."""
        why = None
        for entry in list(self._inflight):
            write = entry.write
            state = write.state()
            if state == "DONE":
                self._inflight.remove(entry)
                self._count(write)
                self.prep_s += write.prep_s
                self.prep_cpu_s += write.prep_cpu_s
                self._settle(write)
            elif state != "PROC":
                self._inflight.remove(entry)
                self._settle(write)
                why = why or f"NIXL write failed: {state}"
            elif now >= entry.deadline:
                why = why or f"write still in flight after {self.timeout_s:g} s"
        self._unsettled = [w for w in self._unsettled if not w.is_settled]
        return why

    def stats(self) -> TransferStats:
        """What landed so far."""
        post_s, xfer_s = self._telemetry or (None, None)
        return TransferStats(self.written_bytes, self.num_writes, self.num_descs, post_s, xfer_s)

    def _count(self, write: Write) -> None:
        self.written_bytes += write.num_bytes
        if write.num_descs:  # one of this agent's requests (not the followers' stand-in)
            self.num_writes += 1
            self.num_descs += write.num_descs
        if write.telemetry is not None:
            post_s, xfer_s = self._telemetry or (0.0, 0.0)
            self._telemetry = post_s + write.telemetry[0], xfer_s + write.telemetry[1]

    def release_all(self) -> None:
        """Release every write in flight (NIXL cancels them); unsettled ones are kept."""
        for entry in self._inflight:
            self._settle(entry.write)
        self._inflight.clear()

    def pending(self) -> tuple[Write, ...]:
        """Every write whose bytes may still land: in flight, or released and unsettled."""
        return tuple(e.write for e in self._inflight) + tuple(self._unsettled)

    def unsettled(self) -> tuple[Write, ...]:
        """Released writes not settled yet (for the backend's reaper once the sender closes)."""
        return tuple(w for w in self._unsettled if not w.is_settled)

    def _settle(self, write: Write) -> None:
        write.release()  # a finished write frees its handle (the transfer thread did already)
        if not write.is_settled:
            self._unsettled.append(write)
