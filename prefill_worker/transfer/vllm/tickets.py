"""Which rooms belong to vLLM decodes, and the ``kv_transfer_params`` each one ends with:
the one object the HTTP front and the vLLM backend share.

A vLLM proxy asks this worker for a prefill with ``kv_transfer_params.do_remote_decode``; the
decode then pulls what the prefill staged. No decode claims a room here (as native and SGLang
decodes do): the request itself is the claim. So the HTTP front opens a ticket for the room
before the request enters the engine; the vLLM backend's sender for that room is READY at once
(one with no ticket waits, as for a decode that never came, and loses the room to another
protocol's decode); once the KV is staged and held, the sender completes the ticket with the
params; the front takes them when the request's outcome arrives::

    HTTP thread           open(room) ─▶ inbox            take(room) ─▶ the answer's params
    engine thread                     is_open(room)   complete(room, params)

A ticket also says which vLLM version the request's decode runs (``versions``: those this
worker serves, the first the default): the answer names that version's side channel; and
whether that decode pulls or is pushed to (``mode``; a push names the request id the decode's
registration will carry, ``push_key``: ``push``).

Thread-safe (one lock; every call is a dict operation). Bounded: at most ``max_open`` tickets
(the front's in-flight cap), ``open`` refuses beyond it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefill_worker.transfer.vllm.profiles import DEFAULT_VERSIONS, PROFILES, PULL

Params = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Ask:
    """What a request's decode is: its vLLM version, its transfer mode, and (a push) the base
    request id its registration will name."""

    version: str
    mode: str = PULL
    push_key: str | None = None


class Tickets:
    """Rooms opened for vLLM pulls, and their params once staged."""

    def __init__(
        self,
        max_open: int,
        versions: tuple[str, ...] = DEFAULT_VERSIONS,
        modes: tuple[str, ...] = (PULL,),
        needs_kv_groups: bool = False,
        has_linear_state: bool = False,
    ) -> None:
        """``needs_kv_groups``: the model is a hybrid one (sliding windows; with
        ``has_linear_state``, linear-attention layers), which only the decodes whose reading
        of its KV-cache groups is proven can get (``why_refused``). A linear model's pull
        prompts are cut one token short (``prompt_backoff``): vLLM's decode of a model with
        mamba layers loads the state after all but the last token and computes that one."""
        self._lock = threading.Lock()
        self.needs_kv_groups = needs_kv_groups or has_linear_state
        self.prompt_backoff = 1 if has_linear_state else 0
        linear, sliding = (
            ("state_unsupported", "linear-attention"),
            ("swa_unsupported", "sliding-window"),
        )
        self._kind = linear if has_linear_state else sliding  # why_refused's code and words
        self._rooms: dict[int, tuple[Ask, Params | None]] = {}  # room -> (ask, params)
        self._max_open = max_open
        self.versions = versions  # served; a request naming none gets the first
        self.modes = modes  # vLLM transfer modes served

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    def open(
        self, room: int, version: str | None = None, mode: str = PULL, push_key: str | None = None
    ) -> bool:
        """Mark ``room`` as a vLLM request for a decode of ``version`` (one of ``versions``;
        None: the first) in ``mode``; False when ``max_open`` are open already, or this room
        is (a room is one request's)."""
        assert version is None or version in self.versions, version  # the front checked it
        with self._lock:
            if len(self._rooms) >= self._max_open or room in self._rooms:
                return False
            self._rooms[room] = (Ask(version or self.versions[0], mode, push_key), None)
            return True

    def why_refused(self, version: str | None, mode: str = PULL) -> str | None:
        """Why a decode of ``version`` (None: the default) in ``mode`` cannot get this model's
        KV (``swa_unsupported``: a sliding-window model, ``transfer/vllm/groups.py``, to a
        version or mode not proven to read its KV-cache groups); None when it can."""
        version = version or self.versions[0]
        if not self.needs_kv_groups:
            return None
        code, what = self._kind
        if not PROFILES[version].serves_kv_groups:
            served = [v for v in self.versions if PROFILES[v].serves_kv_groups]
            return (
                f"{code}: vLLM {version} decodes get no {what} KV-cache groups from this "
                f"worker; name vLLM {', '.join(served) or '0.34.0'} (docs/vllm.md)"
            )
        if mode != PULL:
            return (
                f"{code}: vLLM's {mode} mode does not carry {what} KV-cache groups here; pull "
                "(docs/vllm.md)"
            )
        return None

    def version_of(self, room: int) -> str | None:
        """The vLLM version ``room``'s decode runs; None when its ticket is not open."""
        ask = self.ask_of(room)
        return None if ask is None else ask.version

    def ask_of(self, room: int) -> Ask | None:
        """What ``room``'s decode is; None when its ticket is not open."""
        with self._lock:
            entry = self._rooms.get(room)
            return None if entry is None else entry[0]

    def is_open(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms

    def complete(self, room: int, params: Params) -> bool:
        """Record the params for ``room``; False if its ticket was taken (the front gave up)."""
        with self._lock:
            entry = self._rooms.get(room)
            if entry is None:
                return False
            self._rooms[room] = (entry[0], params)
            return True

    def take(self, room: int) -> Params | None:
        """Close ``room``'s ticket; its params, or None if none were recorded."""
        with self._lock:
            entry = self._rooms.pop(room, None)
            return None if entry is None else entry[1]
