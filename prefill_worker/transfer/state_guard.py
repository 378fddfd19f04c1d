"""Refuses, per request, to push a hybrid model's KV through a protocol that cannot carry its
state: never KV without the state a decode needs beside it.

A hybrid model's decode needs, beside the KV list of the full-attention layers, its state
components (``kv.state_layout``: the linear layers' conv and recurrent state after the whole
prompt). A decode that got the KV alone would run from zero state and produce wrong tokens
without any error. So the daemon wraps the backend of every protocol that carries none of the
model's component kinds (all but ``STATE_CARRIERS``: native) in ``StateGuard``: once a decode
of that protocol claims a room (its sender turns READY), the sender is failed with ``reason`` (which
starts ``state_unsupported:``) before a byte is written. The decode gets ``status failed``
with it; the request ends ``transfer_failed`` with it, counted like any transfer failure::

    inner sender   BOOTSTRAPPING ... READY ─┐
    guarded        BOOTSTRAPPING ... ───────┴─▶ inner.fail(reason) ─▶ FAILED, failure_reason

Under ``DualBackend`` each protocol's backend is wrapped on its own, so a protocol that
carries the state (native) serves the same request's decode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

from prefill_worker.transfer.base import ForwardingSender, KVPoll, KVSender, TransferBackend

STATE_UNSUPPORTED = "state_unsupported"
STATE_CARRIERS = frozenset({"native"})  # the protocols that send a state component


def refusal(protocol: str, kinds: Sequence[str]) -> str:
    return (
        f"{STATE_UNSUPPORTED}: the {protocol} protocol carries no {'/'.join(kinds)} state, "
        "which this model's decode needs beside the KV (hybrid models: docs/models.md)"
    )


def guard_backends(
    backends: Mapping[str, TransferBackend],
    kind: str,
    carriers: AbstractSet[str] = STATE_CARRIERS,
) -> tuple[dict[str, TransferBackend], list[str]]:
    """Each protocol's backend by name, those that carry no ``kind`` state (all but
    ``carriers``: ``STATE_CARRIERS``, and SGLang when it sends the model's state, a hybrid
    linear-attention model's ``mamba``) wrapped in ``StateGuard``; and the names wrapped."""
    refused = [name for name in backends if name not in carriers]
    guarded = {
        name: StateGuard(backend, refusal(name, (kind,))) if name in refused else backend
        for name, backend in backends.items()
    }
    return guarded, refused


class RefusingSender(ForwardingSender):
    """A sender that fails with ``reason`` as soon as a decode claims its room."""

    def __init__(self, inner: KVSender, reason: str) -> None:
        super().__init__(inner)
        self._reason = reason

    def poll(self) -> KVPoll:
        status = self._inner.poll()
        if status is KVPoll.BOOTSTRAPPING or status.is_terminal:
            return status
        self._inner.fail(self._reason)  # READY (or later): the claim came, nothing sent yet
        return KVPoll.FAILED

    def send_pages(
        self, page_ids: Sequence[int], first_page: int, sliding_page_ids: Sequence[int] = ()
    ) -> None:
        raise AssertionError("a refusing sender sends no pages")

    def send_aux(self, aux_row: int) -> None:
        raise AssertionError("a refusing sender sends no aux row")


class StateGuard:
    """``TransferBackend`` over ``inner`` whose every sender is a ``RefusingSender``."""

    def __init__(self, inner: TransferBackend, reason: str) -> None:
        self.inner, self.reason = inner, reason

    @property
    def bootstrap_endpoint(self) -> str:
        return self.inner.bootstrap_endpoint

    @property
    def endpoints(self) -> Mapping[str, str]:
        return self.inner.endpoints

    def create_sender(
        self,
        room: int,
        request_id: str,
        num_prompt_tokens: int,
        allowed_peer: str | None = None,
        traceparent: str | None = None,
    ) -> KVSender:
        inner = self.inner.create_sender(
            room, request_id, num_prompt_tokens, allowed_peer, traceparent
        )
        return RefusingSender(inner, self.reason)

    def poll(self) -> None:
        self.inner.poll()

    def next_poll_at(self) -> float:
        return self.inner.next_poll_at()

    def take_claimed_rooms(self) -> Sequence[int]:
        return self.inner.take_claimed_rooms()

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        self.inner.wait(timeout_s, wake_fd)

    def close(self) -> None:
        self.inner.close()
