"""Settings for every test: hypothesis without per-example deadlines.

These tests run on 2 shared CPU cores, where an example that takes 5 ms alone can take 300 ms
while another process is busy; a deadline would then fail a correct property by the clock.
Speed lives in bench/, not in tests."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("prefill-worker", deadline=None)
settings.load_profile("prefill-worker")
