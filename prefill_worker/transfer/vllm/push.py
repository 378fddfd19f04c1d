"""vLLM's push mode, the bookkeeping: which held request a decode's registration names.

A vLLM decode in push mode (``NixlPushConnector``, ``kv_connector_extra_config:
{"transfer_mode": "push"}``) does not READ. Once it has allocated blocks for a request it
sends the prefill's agent a NIXL notification ``b"PUSH_REG:" + msgpack(registration)``::

    {request_id, decode_engine_id, decode_host, decode_port, decode_tp_size,
     local_block_ids (per KV-cache group, or one flat list), remote_engine_id, remote_host,
     remote_port, remote_tp_size, remote_pp_size}

and waits for the prefill to WRITE its KV into ``local_block_ids`` with the notification
``"<request_id>:<prefill tp size>"``. The registration names the decode's own request id, not
the prefill's: vLLM's own prefill matches it to a finished request by vLLM's request id with
its random ``-<8 hex>`` suffix stripped (both sides got the same ``X-Request-Id`` from the
proxy, so both have ``cmpl-<X-Request-Id>-0``). The HTTP front records that base id for each
push request (``push_key``); ``PushBook`` matches a registration to its hold by it, in
either order (a decode may register before the prefill has finished).

A decode of TP d > 1 registers from each of its ranks (vLLM's push worker sends the
scheduler's one registration from every rank to the prefill rank it handshook: here, ours):
the first to arrive is matched, and one WRITE per rank follows it (``pusher``); the other
d - 1, from the same decode engine, are its siblings and change nothing.

Who may register: any agent that handshook the side channel can send a registration, and the
request id is not a secret, so the first registration of a held request wins; later ones
beyond its siblings are counted (``duplicate``) and ignored. As with vLLM's own prefill, the
side channel belongs on a network only the decodes reach (docs/vllm.md). Pure bookkeeping,
no NIXL, no clock of its own.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

PUSH_REG_PREFIX = b"PUSH_REG:"
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)  # vLLM's assign_request_id
MAX_REGISTRATION_BYTES = 1 << 20  # a registration names block ids: 1 MiB is ~100k blocks


class Registration(msgspec.Struct, forbid_unknown_fields=False):
    """The fields of a ``PUSH_REG`` this worker reads (vLLM's ``push_scheduler``)."""

    request_id: str
    decode_engine_id: str
    decode_host: str
    decode_port: int
    decode_tp_size: int
    local_block_ids: list[Any]  # per KV-cache group, or one flat list (one group)

    def block_ids(self) -> list[int]:
        """The decode's blocks of its one KV-cache group (a flat list is one group)."""
        ids = self.local_block_ids
        if ids and isinstance(ids[0], list):
            if len(ids) != 1:
                raise BadRegistration(f"{len(ids)} KV-cache groups; this worker has one")
            ids = ids[0]
        if any(type(b) is not int or b < 0 for b in ids):
            raise BadRegistration("local_block_ids: not block ids")
        return list(ids)


_decoder = msgspec.msgpack.Decoder(Registration)


class BadRegistration(ValueError):
    """A ``PUSH_REG`` that is not vLLM's registration."""


def base_request_id(request_id: str) -> str:
    """vLLM's ``get_base_request_id``: the id without its random ``-<8 hex>`` suffix."""
    return _RANDOM_SUFFIX.sub("", request_id)


def push_key(external_id: str) -> str:
    """The base id vLLM's engine gives the one prompt of a ``/v1/completions`` request whose
    ``X-Request-Id`` (or body ``request_id``) is ``external_id``."""
    return f"cmpl-{external_id}-0"


def read_registration(message: bytes) -> Registration:
    """A ``PUSH_REG:`` notification's registration; ``BadRegistration`` with the reason."""
    body = message[len(PUSH_REG_PREFIX) :]
    if len(body) > MAX_REGISTRATION_BYTES:
        raise BadRegistration(f"a registration of {len(body)} bytes")
    try:
        reg = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRegistration(f"not vLLM's registration: {exc}") from None
    reg.block_ids()  # raises BadRegistration when they are not one group's ids
    return reg


@dataclass(frozen=True, slots=True)
class Expected:
    """A held request waiting for its decode's registration."""

    hold_id: str
    version: str  # the vLLM version its ticket named: the decode's metadata and hash


@dataclass(slots=True)
class Early:
    """A registration that came before its request was held (and how many of its decode's
    ranks registered it so far)."""

    agent: str
    registration: Registration
    expires_at: float
    ranks: int = 1


@dataclass(slots=True)
class Siblings:
    """A matched registration of a decode of TP > 1: its other ranks' registrations to come
    (``left``), from ``engine_id``, until ``expires_at``."""

    engine_id: str
    left: int
    expires_at: float


@dataclass(slots=True)
class PushBook:
    """Held push requests by ``push_key``, and registrations that came first (each kept at
    most ``lease_s``, at most ``max_early`` of them)."""

    lease_s: float
    max_early: int
    expected: dict[str, Expected] = field(default_factory=dict)
    early: dict[str, Early] = field(default_factory=dict)
    siblings: dict[str, Siblings] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)  # why -> registrations ignored

    def expect(
        self, key: str, hold_id: str, version: str, now: float
    ) -> tuple[Expected, Early] | None:
        """``hold_id`` waits for the registration of ``key``; the pair at once when that
        registration came first. A key already expected is a second request with the same
        id: it is not matched (counted), its hold ends at its lease."""
        if key in self.expected:
            self.refused["duplicate_request_id"] += 1
            return None
        wanted = Expected(hold_id, version)
        early = self.early.pop(key, None)
        if early is not None and early.expires_at > now:
            self._await_siblings(key, early.registration, early.ranks, now)
            return wanted, early
        self.expected[key] = wanted
        return None

    def registered(self, agent: str, reg: Registration, now: float) -> Expected | None:
        """The held request ``reg`` names (taken: it is matched once), or None (kept for a
        request not held yet, or counted)."""
        key = base_request_id(reg.request_id)
        self.prune(now)
        if self._is_sibling(self.siblings.get(key), reg):
            self.siblings[key].left -= 1
            if not self.siblings[key].left:
                del self.siblings[key]
            return None
        wanted = self.expected.pop(key, None) or self.expected.pop(reg.request_id, None)
        if wanted is not None:
            self._await_siblings(key, reg, 1, now)
            return wanted
        early = self.early.get(key)
        if early is not None and self._another_rank(early, reg):
            early.ranks += 1  # another rank of the decode that came first
            return None
        if key in self.early or len(self.early) >= self.max_early:
            self.refused["duplicate" if key in self.early else "too_many_early"] += 1
            return None
        self.early[key] = Early(agent, reg, now + self.lease_s)
        return None

    def forget_missing(self, is_held: Callable[[str], bool]) -> None:
        """Holds that ended without a registration (their lease passed) stop waiting."""
        gone = [k for k, e in self.expected.items() if not is_held(e.hold_id)]
        for key in gone:
            del self.expected[key]

    def prune(self, now: float) -> None:
        for key in [k for k, e in self.early.items() if e.expires_at <= now]:
            del self.early[key]
            self.refused["unmatched"] += 1
        for key in [k for k, s in self.siblings.items() if s.expires_at <= now]:
            del self.siblings[key]

    def _await_siblings(self, key: str, reg: Registration, ranks: int, now: float) -> None:
        left = reg.decode_tp_size - ranks
        if left > 0:
            self.siblings[key] = Siblings(reg.decode_engine_id, left, now + self.lease_s)

    @staticmethod
    def _another_rank(early: Early, reg: Registration) -> bool:
        first = early.registration
        same = first.decode_engine_id == reg.decode_engine_id
        return same and early.ranks < first.decode_tp_size

    @staticmethod
    def _is_sibling(siblings: Siblings | None, reg: Registration) -> bool:
        return siblings is not None and siblings.engine_id == reg.decode_engine_id
