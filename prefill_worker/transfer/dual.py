"""Several decode protocols at once (``transfer.protocol`` naming more than one): native
decode peers, SGLang decodes and vLLM decodes, each on its own ports, feeding one engine
from one pool.

A request does not say which protocol its decode speaks, so ``DualBackend`` opens a sender
on each backend for the room; the first one a decode claims (or aborts, or that fails) is
the request's, and the others are failed and closed (a later claim through one learns that
the room went another way). A vLLM room is claimed by its HTTP request itself (a ticket,
``transfer.vllm.tickets``). Each backend keeps its own tables, agent and sockets. The engine
sleeps in the first backend's ``wait``; the SGLang backend's control thread wakes it through
the engine's inbox (the ``wake`` it was built with), and the vLLM backend asks for turns
through ``next_poll_at``. Torch-free; imports neither NIXL nor ZMQ itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from prefill_worker.request import TransferStats
from prefill_worker.transfer.base import KVPoll, KVSender, MirroringSender, TransferBackend
from prefill_worker.transfer.group import DropsPeers

_UNBOUND = (KVPoll.BOOTSTRAPPING,)


class DualSender:
    """KVSender over one sender per protocol until a decode picks one (two or more)."""

    def __init__(self, senders: Sequence[KVSender], names: Sequence[str]) -> None:
        self._senders, self._names = list(senders), list(names)
        self._chosen: KVSender | None = None

    def poll(self) -> KVPoll:
        if self._chosen is None:
            self._choose()
        return KVPoll.BOOTSTRAPPING if self._chosen is None else self._chosen.poll()

    def num_cached_tokens(self) -> int:
        return 0 if self._chosen is None else self._chosen.num_cached_tokens()

    def mirror_slots(self, start: int, end: int) -> Sequence[int]:
        """The chosen protocol's, when its sender mirrors (``MirroringSender``); else ()."""
        chosen = self._chosen
        return chosen.mirror_slots(start, end) if isinstance(chosen, MirroringSender) else ()

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        assert self._chosen is not None, "send_pages before READY"
        self._chosen.send_pages(page_ids, first_page, sliding_page_ids)

    def send_aux(self, aux_row: int) -> None:
        assert self._chosen is not None, "send_aux before READY"
        self._chosen.send_aux(aux_row)

    def fail(self, reason: str) -> None:
        for sender in self._live():
            sender.fail(reason)

    def failure_reason(self) -> str | None:
        if self._chosen is not None:
            return self._chosen.failure_reason()
        return next((r for s in self._senders if (r := s.failure_reason()) is not None), None)

    def why_no_handshake(self) -> str | None:
        return next((r for s in self._senders if (r := s.why_no_handshake()) is not None), None)

    def transfer_stats(self) -> TransferStats:
        return TransferStats() if self._chosen is None else self._chosen.transfer_stats()

    def close(self) -> None:
        for sender in self._live():  # the others were closed when the room was taken
            sender.close()

    def _live(self) -> list[KVSender]:
        return self._senders if self._chosen is None else [self._chosen]

    def _choose(self) -> None:
        picked = next((s for s in self._senders if s.poll() not in _UNBOUND), None)
        if picked is None:
            return
        self._chosen = picked
        name = self._names[self._senders.index(picked)]
        for sender in self._senders:
            if sender is not picked:
                sender.fail(f"the room was taken by a decode on the {name} protocol")
                sender.close()


class DualBackend:
    """Serves several protocols (native, SGLang, vLLM: any of them) from one pool and one
    engine; each backend keeps its own ports. ``backends`` is ordered: the engine sleeps in
    the first one's ``wait`` (its socket and ``wake_fd``), bounded by the others' next poll
    times (their own threads, if any, wake the engine through its inbox)."""

    def __init__(
        self,
        backends: Mapping[str, TransferBackend],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert len(backends) >= 2, "one protocol needs no composition"
        self._names, self._backends = list(backends), list(backends.values())
        self._clock = clock
        self.bootstrap_endpoint = self._backends[0].bootstrap_endpoint
        self.endpoints: Mapping[str, str] = {
            name: address for b in self._backends for name, address in b.endpoints.items()
        }

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> KVSender:
        senders = [
            b.create_sender(room, request_id, num_prompt_tokens, allowed_peer, traceparent)
            for b in self._backends
        ]
        return DualSender(senders, self._names)

    def poll(self) -> None:
        for backend in self._backends:
            backend.poll()

    def take_claimed_rooms(self) -> Sequence[int]:
        return [room for b in self._backends for room in b.take_claimed_rooms()]

    def next_poll_at(self) -> float:
        return min(b.next_poll_at() for b in self._backends)

    @property
    def num_dropped_peers(self) -> int:
        """Decode peers the protocols dropped so far (``transfer.group.DropsPeers``)."""
        return sum(b.num_dropped_peers for b in self._backends if isinstance(b, DropsPeers))

    def has_peer(self, agent_name: str) -> bool:
        return any(isinstance(b, DropsPeers) and b.has_peer(agent_name) for b in self._backends)

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Sleep on the first backend and ``wake_fd``, until the others' next poll at most."""
        others = min(b.next_poll_at() for b in self._backends[1:])
        self._backends[0].wait(min(timeout_s, others - self._clock()), wake_fd)

    def close(self) -> None:
        """Every backend closes, whatever the others raise (the first error is raised)."""
        errors: list[BaseException] = []
        for backend in self._backends:
            try:
                backend.close()
            except BaseException as exc:  # re-raised below, once the rest are closed
                errors.append(exc)
        if errors:
            raise errors[0]
