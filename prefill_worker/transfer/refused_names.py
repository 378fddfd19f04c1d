"""Registrations refused lately, by the agent name they claimed: what a waiting room hears.

A native decode whose registration is refused (another dtype, page size, layer count) learns
why at once, but it never sends a ``want``, so the worker cannot tie its rooms to it unless
the router named the decode for the room (``decode_peer``). Such a room fails at once with the
refusal, if it is waiting when the refusal comes or is opened within ``keep_s`` after it; a
registration under the name that succeeds later clears it. Any other room that waits out its
bootstrap timeout names the refusals seen lately in its error, the likely cause, instead of a
bare "no handshake".

Bounded: the newest ``max_names`` names, each for ``keep_s``; names are cut to 64 characters,
since a peer chooses them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_NAME_CHARS = 64


@dataclass(frozen=True, slots=True)
class RefusedName:
    reason: str
    forget_at: float


class RefusedNames:
    def __init__(self, keep_s: float, max_names: int = 8) -> None:
        self._keep_s, self._max_names = keep_s, max_names
        self._names: OrderedDict[str, RefusedName] = OrderedDict()

    def add(self, agent_name: str, reason: str, now: float) -> None:
        self._names.pop(agent_name, None)
        self._names[agent_name] = RefusedName(reason, now + self._keep_s)
        while len(self._names) > self._max_names:
            self._names.popitem(last=False)

    def clear(self, agent_name: str) -> None:
        """The name registered: rooms named for it wait for it again."""
        self._names.pop(agent_name, None)

    def reason_for(self, agent_name: str, now: float) -> str | None:
        refused = self._names.get(agent_name)
        return refused.reason if refused is not None and now < refused.forget_at else None

    def summary(self, now: float) -> str | None:
        """``"registrations refused lately: a (why); b (why)"``, or None when there were none."""
        live = [
            f"{name[:MAX_NAME_CHARS]!r} ({refused.reason})"
            for name, refused in reversed(self._names.items())
            if now < refused.forget_at
        ]
        return "registrations refused lately: " + "; ".join(live) if live else None
