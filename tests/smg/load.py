"""A steady load through the router for the fleet tests: a few client threads, each sending
one request after another until stopped, and every request's outcome kept (when it was sent,
when it ended, the status), so a test counts client errors exactly and places each in time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.checkpoints import prompt

NUM_NEW_TOKENS = 4
PROMPT_TOKENS = 24  # tiny-test: two chunks of 16


@dataclass(frozen=True, slots=True)
class Sent:
    """One request's outcome, its times on ``time.monotonic``'s clock."""

    sent_at: float
    ended_at: float
    status: int  # 0: no HTTP answer (the connection failed)
    answer: str

    @property
    def is_ok(self) -> bool:
        return self.status == 200

    def was_in_flight(self, at: float) -> bool:
        return self.sent_at <= at <= self.ended_at


class Load:
    """``num_clients`` threads calling ``send(body)`` back to back until ``stop``."""

    def __init__(self, send: Callable[[dict[str, Any]], tuple[int, Any]], num_clients: int):
        self._send = send
        self._is_stopping = threading.Event()
        self._lock = threading.Lock()
        self._sent: list[Sent] = []
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(num_clients)
        ]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> list[Sent]:
        self._is_stopping.set()
        for thread in self._threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a client is stuck in a request"
        return self.outcomes()

    def outcomes(self) -> list[Sent]:
        with self._lock:
            return list(self._sent)

    def num_ok_since(self, at: float) -> int:
        """Requests sent at or after ``at`` that succeeded."""
        return sum(1 for s in self.outcomes() if s.sent_at >= at and s.is_ok)

    def _client(self, index: int) -> None:
        seed = 1000 * (index + 1)
        while not self._is_stopping.is_set():
            seed += 1
            body = {
                "input_ids": prompt(PROMPT_TOKENS, seed=seed),
                "sampling_params": {"temperature": 0, "max_new_tokens": NUM_NEW_TOKENS},
            }
            sent_at = time.monotonic()
            try:
                status, answer = self._send(body)
            except OSError as exc:  # reset or refused: the client sees an error
                status, answer = 0, repr(exc)
            with self._lock:
                self._sent.append(Sent(sent_at, time.monotonic(), status, str(answer)[:300]))
