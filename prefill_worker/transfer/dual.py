"""Both bootstrap protocols at once (``transfer.protocol: both``): native decode peers and
SGLang decodes, each on its own ports, feeding one engine.

A request does not say which protocol its decode speaks, so ``DualBackend`` opens a sender
on each backend for the room; the first one a decode claims (or aborts, or that fails) is
the request's, and the other is failed and closed (a later claim through it learns that the
room went the other way). Each backend keeps its own tables, agent and sockets. The engine
sleeps in the native backend's ``wait``; the SGLang backend's control thread wakes it
through the engine's inbox (the ``wake`` it was built with). Torch-free; imports neither
NIXL nor ZMQ itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from prefill_worker.transfer.base import KVPoll, KVSender, TransferBackend

_UNBOUND = (KVPoll.BOOTSTRAPPING,)


class DualSender:
    """KVSender over one sender per protocol until a decode picks one."""

    def __init__(self, senders: Sequence[KVSender], names: Sequence[str]) -> None:
        self._senders, self._names = list(senders), list(names)
        self._chosen: KVSender | None = None

    def poll(self) -> KVPoll:
        if self._chosen is None:
            self._choose()
        return KVPoll.BOOTSTRAPPING if self._chosen is None else self._chosen.poll()

    def num_cached_tokens(self) -> int:
        return 0 if self._chosen is None else self._chosen.num_cached_tokens()

    def send_pages(self, page_ids: Sequence[int], first_page: int) -> None:
        assert self._chosen is not None, "send_pages before READY"
        self._chosen.send_pages(page_ids, first_page)

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

    def written_bytes(self) -> int:
        return 0 if self._chosen is None else self._chosen.written_bytes()

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
    """Serves the native and the SGLang protocol; one engine, two sets of ports."""

    def __init__(
        self,
        native: TransferBackend,
        sglang: TransferBackend,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._native, self._sglang, self._clock = native, sglang, clock
        self.bootstrap_endpoint = native.bootstrap_endpoint
        self.endpoints: Mapping[str, str] = {**native.endpoints, **sglang.endpoints}

    def create_sender(
        self, room: int, request_id: str, num_prompt_tokens: int, allowed_peer: str | None = None
    ) -> KVSender:
        senders = [
            self._native.create_sender(room, request_id, num_prompt_tokens, allowed_peer),
            self._sglang.create_sender(room, request_id, num_prompt_tokens, allowed_peer),
        ]
        return DualSender(senders, ["native", "sglang"])

    def poll(self) -> None:
        self._native.poll()
        self._sglang.poll()

    def next_poll_at(self) -> float:
        return min(self._native.next_poll_at(), self._sglang.next_poll_at())

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        """Sleep on the native socket and ``wake_fd``; SGLang messages wake ``wake_fd``."""
        timeout_s = min(timeout_s, self._sglang.next_poll_at() - self._clock())
        self._native.wait(timeout_s, wake_fd)

    def close(self) -> None:
        try:
            self._native.close()
        finally:
            self._sglang.close()
