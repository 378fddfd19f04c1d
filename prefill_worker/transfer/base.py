"""The scheduler-side seam of KV transfer: one ``KVSender`` per request, made by a backend.

Torch-, ZMQ- and NIXL-free, so the scheduler is tested with fakes. The life of a sender::

    create_sender(room)      poll() == BOOTSTRAPPING   (no `want` from the decode peer yet)
      decode sends `want`    poll() == READY           (destination pages known)
      send_pages(...) × n    poll() == TRANSFERRING
      send_aux(row)          poll() == TRANSFERRING    (aux row, then `status ok`, follow)
                             poll() == SUCCESS         (every write landed, status sent)
    any time:                poll() == FAILED | ABORTED, with failure_reason()
    fail(reason)             tell the decode peer `status failed`; poll() then says FAILED
    close()                  release handles, cancelling writes in flight; never waits

Pages and the aux row may be freed only after ``close()`` has returned. The engine sleeps
between turns in ``TransferBackend.wait``, never in a sender.

A sender may also be a ``MirroringSender``: one whose destination the forward itself can
write (vLLM's staging blocks), so a chunk the scheduler plans with its ``mirror_slots`` needs
no copy when its pages are sent.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from prefill_worker.request import TransferStats


class KVPoll(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    READY = "ready"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"
    ABORTED = "aborted"  # the decode peer aborted the room
    PEER_LOST = "peer_lost"  # the decode peer went silent, left, or was replaced mid-request

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.SUCCESS, KVPoll.FAILED, KVPoll.ABORTED, KVPoll.PEER_LOST)


class KVSender(Protocol):
    """One request's push of KV pages and its aux row to the decode peer that wants it."""

    def poll(self) -> KVPoll:
        """The sender's state; never blocks."""
        ...

    def num_cached_tokens(self) -> int:
        """Prefix the decode peer already holds; meaningful once READY."""
        ...

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        """Start writing local pages holding prompt pages [first_page, first_page+len).

        The decode's ``want`` gives ``num_cached_tokens`` (a multiple of the page size, the
        prefix it already holds) and ``dst_page_ids`` for prompt pages from
        ``num_cached_tokens // page_size`` on: the sender skips the cached pages and maps the
        rest onto ``dst_page_ids``. ``sliding_page_ids``: a windowed sliding pool's entries
        of the same prompt pages (``kv.sliding``; -1 where none is held), where a sliding
        layer's window pages are read from; () without one."""
        ...

    def send_aux(self, aux_row: int) -> None:
        """After the last pages: write the aux row, then send `status ok` once all landed."""
        ...

    def fail(self, reason: str) -> None:
        """Give up: the decode peer gets `status failed` with the reason. Idempotent."""
        ...

    def failure_reason(self) -> str | None: ...

    def why_no_handshake(self) -> str | None:
        """While BOOTSTRAPPING: a likely reason no decode has claimed the room yet (say,
        registrations refused lately), for the bootstrap timeout's error; None when unknown."""
        ...

    def transfer_stats(self) -> TransferStats:
        """The writes that have landed so far (KV page runs and the aux row): their bytes,
        NIXL requests, descriptors, and NIXL's telemetry of them where captured."""
        ...

    def close(self) -> None:
        """Release everything without waiting: writes in flight are cancelled. (A handle the
        transport refuses to release is the backend's to reap; it disconnects the peer.)"""
        ...


class ForwardingSender:
    """A sender that is ``inner`` in everything a subclass does not override: the base of a
    sender that wraps another (``state_guard.RefusingSender``, ``sglang.mamba_stage``)."""

    def __init__(self, inner: KVSender) -> None:
        self._inner = inner

    def poll(self) -> KVPoll:
        return self._inner.poll()

    def num_cached_tokens(self) -> int:
        return self._inner.num_cached_tokens()

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        self._inner.send_pages(page_ids, first_page, sliding_page_ids)

    def send_aux(self, aux_row: int) -> None:
        self._inner.send_aux(aux_row)

    def fail(self, reason: str) -> None:
        self._inner.fail(reason)

    def failure_reason(self) -> str | None:
        return self._inner.failure_reason()

    def why_no_handshake(self) -> str | None:
        return self._inner.why_no_handshake()

    def transfer_stats(self) -> TransferStats:
        return self._inner.transfer_stats()

    def close(self) -> None:
        self._inner.close()


@runtime_checkable
class MirroringSender(Protocol):
    """A sender whose destination the forward can write as it writes the pool's pages."""

    def mirror_slots(self, start: int, end: int) -> Sequence[int]:
        """Destination slots for prompt positions [start, end) (one per position), which the
        forward of the chunk being planned then writes; () when the sender cannot take them
        (no destination yet: not READY, or another protocol's room). The sender counts them
        as written once their pages are sent (``send_pages``, after that forward), and is
        closed only after that forward is collected, so it frees no slot the forward writes."""
        ...


class TransferBackend(Protocol):
    """Makes senders and drives all their progress from the engine loop; says where decode
    peers reach it."""

    @property
    def bootstrap_endpoint(self) -> str:
        """Where decode peers bootstrap (the address actually bound: port 0 allowed)."""
        ...

    @property
    def endpoints(self) -> Mapping[str, str]:
        """Every address it bound, by name (``/readyz`` and the ready file show them)."""
        ...

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> KVSender:
        """A sender for ``room``; with ``allowed_peer`` (a decode agent name from the router),
        only that peer's ``want`` may claim the room. ``traceparent``: the request's span, for
        the decode's trace (a protocol that has no field for it drops it)."""
        ...

    def poll(self) -> None:
        """Handshakes, transfer progress, heartbeats, deadlines; never blocks."""
        ...

    def take_claimed_rooms(self) -> Sequence[int]:
        """The rooms whose decode's `want` bound their existing sender since the last call,
        each once: the engine polls those senders at once instead of waiting for its round
        robin over every unclaimed request to reach them. A claim that came before its
        request is not here (the sender is bound as it is created); a backend whose senders
        are bound only then returns ()."""
        ...

    def next_poll_at(self) -> float:
        """The earliest time (the backend's clock) ``poll`` has work no message starts."""
        ...

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Block until ``poll`` may have something to do (a message for the backend, its next
        progress or heartbeat time), ``wake_fd`` is readable, or ``timeout_s`` passed. The
        engine calls it only when a turn did nothing."""
        ...

    def close(self) -> None: ...
