"""A clock a test moves by hand (``clock.now += s`` or ``advance``): passed where the code
under test takes a ``clock`` callable, so a deadline is judged by the test's steps and never
by how long a loaded machine took between two of them."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
