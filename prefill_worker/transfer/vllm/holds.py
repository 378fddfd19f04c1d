"""Staged blocks held for vLLM decodes that pull them: leases, heartbeats and READ notifications.

A vLLM decode READs a finished prefill's blocks itself, then tells the prefill through a NIXL
notification that it is done. This table keeps each request's staged blocks until then::

    hold(hold_id, block_ids, now)          lease: now + lease_s
    "HB:id1,id2"          (notification)   each held id's lease: max(lease, now + 2/3 lease_s)
    "<hold_id>:<consumers>" (notification) one READ finished; at `consumers` of them: released
    expire(now)                            leases past: released (counted), not yet reusable

Released blocks are not free at once: a READ the decode posted just before the lease ended may
still be reading, so expired blocks wait ``read_grace_s`` more (``expire`` hands them out then).
Blocks a notification released are free at once: NIXL delivers a READ's notification only
after its data has moved. Notifications naming an unknown hold (never held, or expired) are
counted and ignored. Pure bookkeeping: no NIXL, no clock of its own (``now`` is passed in).

Who may touch a hold. Any agent that loaded the worker's metadata can send notifications, so
hold ids are unguessable (the desk makes them from 128 random bits) and a notification counts
only from its hold's readers: the agent whose notification (a READ's or a heartbeat) named the
hold first, and, for a hold read by several decode ranks (``consumers`` > 1), the first
``consumers`` distinct agents; each of them counts once, so no agent can stand in for the
others. Others are counted (``foreign``) and ignored. Heartbeats extend a hold to at most
``MAX_LEASES`` leases after it was made.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

HEARTBEAT_PREFIX = "HB:"
MAX_LEASES = 10  # heartbeats keep a hold at most this many leases (vllm_lease_s) after it began


class BadNotification(ValueError):
    """A notification that is neither a heartbeat nor ``<id>:<consumers>``."""


@dataclass(slots=True)
class Hold:
    """One request's staged blocks, until its readers are done or its lease passes."""

    hold_id: str
    block_ids: tuple[int, ...]
    expires_at: float
    last_at: float  # heartbeats extend it no further
    readers: list[str] = field(default_factory=list)  # agents that may notify, first first
    num_readers: int = 1  # how many distinct agents may (a READ notification's consumers)
    done: set[str] = field(default_factory=set)  # readers whose READ finished

    def admit(self, agent: str) -> bool:
        """Whether ``agent``'s notification counts for this hold: a reader's does, and an
        agent is made one while the hold has fewer than ``num_readers`` (module docstring)."""
        if agent in self.readers:
            return True
        if len(self.readers) < self.num_readers:
            self.readers.append(agent)
            return True
        return False


@dataclass(slots=True)
class HoldCounts:
    """What happened to holds, for metrics (``vllm_*`` counters)."""

    held: int = 0
    released_by_reads: int = 0
    expired: int = 0
    heartbeats: int = 0
    unknown_notifications: int = 0
    bad_notifications: int = 0
    foreign_notifications: int = 0  # from an agent that is not the hold's reader


class HoldTable:
    """Holds by id, with their lease deadlines; ``expire`` and ``notify`` hand freed blocks
    back to the caller, who returns them to the staging pool."""

    def __init__(self, lease_s: float, read_grace_s: float) -> None:
        if lease_s <= 0 or read_grace_s < 0:
            raise ValueError(f"lease_s ({lease_s}) > 0 and read_grace_s ({read_grace_s}) >= 0")
        self.lease_s, self.read_grace_s = lease_s, read_grace_s
        self.extension_s = lease_s * 2 / 3  # what one heartbeat grants, as vLLM's prefill does
        self._holds: dict[str, Hold] = {}
        self._deadlines: list[tuple[float, str]] = []  # (expires_at, hold_id); stale allowed
        self._quarantine: list[tuple[float, tuple[int, ...]]] = []  # (free_at, blocks)
        self.counts = HoldCounts()

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, hold_id: str) -> bool:
        return hold_id in self._holds

    def hold(self, hold_id: str, block_ids: tuple[int, ...], now: float) -> float:
        """Hold ``block_ids`` for ``hold_id`` (a new id); returns the lease's end."""
        assert hold_id not in self._holds, f"hold {hold_id!r} exists"
        expires_at = now + self.lease_s
        self._holds[hold_id] = Hold(hold_id, block_ids, expires_at, now + MAX_LEASES * self.lease_s)
        heapq.heappush(self._deadlines, (expires_at, hold_id))
        self.counts.held += 1
        return expires_at

    def notify(self, message: str, now: float, agent: str) -> list[int]:
        """Apply one notification from ``agent``; the blocks it frees (empty if none).
        ``BadNotification`` when it has neither shape (counted)."""
        if message.startswith(HEARTBEAT_PREFIX):
            self._heartbeat(message[len(HEARTBEAT_PREFIX) :].split(","), now, agent)
            return []
        hold_id, sep, consumers = message.rpartition(":")
        if not sep or not hold_id or not consumers.isdigit() or int(consumers) < 1:
            self.counts.bad_notifications += 1
            raise BadNotification(f"notification {message[:80]!r} is not <id>:<consumers>")
        return self._read_done(hold_id, int(consumers), agent)

    def expire(self, now: float) -> list[int]:
        """Leases past at ``now`` end (counted); returns blocks whose grace has passed too."""
        while self._deadlines and self._deadlines[0][0] <= now:
            expires_at, hold_id = heapq.heappop(self._deadlines)
            hold = self._holds.get(hold_id)
            if hold is None or hold.expires_at != expires_at:
                continue  # released, or extended (its newer deadline is in the heap)
            del self._holds[hold_id]
            self.counts.expired += 1
            self._quarantine.append((expires_at + self.read_grace_s, hold.block_ids))
        return self._leave_quarantine(now)

    def next_deadline(self) -> float | None:
        """When ``expire`` next has something to do; None when nothing is held or waiting."""
        times = [t for t, _ in self._deadlines[:1]] + [t for t, _ in self._quarantine]
        return min(times, default=None)

    def take(self, hold_id: str) -> tuple[int, ...] | None:
        """End ``hold_id`` and hand its blocks to the caller (a push writing them frees them
        once its WRITE has settled); None when it is not held (expired, or never was)."""
        hold = self._holds.pop(hold_id, None)  # its heap entry is skipped when it comes up
        return None if hold is None else hold.block_ids

    def release_all(self) -> list[int]:
        """Every block held or waiting (at close: nothing reads a closed agent's memory)."""
        blocks = [b for hold in self._holds.values() for b in hold.block_ids]
        blocks += [b for _, ids in self._quarantine for b in ids]
        self._holds.clear()
        self._deadlines.clear()
        self._quarantine.clear()
        return blocks

    # -- internals ----------------------------------------------------------------------

    def _heartbeat(self, hold_ids: list[str], now: float, agent: str) -> None:
        self.counts.heartbeats += 1
        for hold_id in hold_ids:
            hold = self._holds.get(hold_id)
            if hold is None:
                continue
            if not hold.admit(agent):
                self.counts.foreign_notifications += 1
                continue
            extended = min(now + self.extension_s, hold.last_at)
            if extended > hold.expires_at:
                hold.expires_at = extended
                heapq.heappush(self._deadlines, (extended, hold_id))

    def _read_done(self, hold_id: str, consumers: int, agent: str) -> list[int]:
        hold = self._holds.get(hold_id)
        if hold is None:
            self.counts.unknown_notifications += 1
            return []
        if not hold.done:  # the first READ names how many ranks read this hold
            hold.num_readers = max(consumers, len(hold.readers))
        if not hold.admit(agent) or agent in hold.done:
            self.counts.foreign_notifications += 1
            return []
        hold.done.add(agent)
        if len(hold.done) < hold.num_readers:
            return []
        del self._holds[hold_id]  # its heap entry is skipped when it comes up
        self.counts.released_by_reads += 1
        return list(hold.block_ids)

    def _leave_quarantine(self, now: float) -> list[int]:
        due = [ids for free_at, ids in self._quarantine if free_at <= now]
        if not due:
            return []
        self._quarantine = [(t, ids) for t, ids in self._quarantine if t > now]
        return [b for ids in due for b in ids]
