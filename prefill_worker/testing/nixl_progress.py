"""NIXL's progress thread in a test's decode process, woken by events instead of every 1 ms.

A test tool, not the worker (whose agents run without the thread unless asked). NIXL's
Python ``nixl_agent`` builds every agent with ``pthrDelay = 0``, which the UCX backend's
progress thread rounds up to a 1 ms ``poll`` timeout: between transfers each agent's thread
wakes a thousand times a second to progress its workers (measured: 0.3 of a core per agent,
mostly system time, on a loaded 2-core machine). SGLang's decode manager makes one agent per
decode and never closes it, and an interop decode process holds one decode per test that
made one, so a version's process ended up spinning several threads while the suite's other
processes waited for the CPU (the SGLang interop run spent more time in the kernel than in
Python).

``wake_on_events_only()`` raises that timeout for every agent the process makes from then on.
The thread still wakes at once on a UCX event (it polls each worker's event fd), so transfers
and notifications are served as before; only the idle re-polls become rare. Call it before
SGLang's manager is built.
"""

from __future__ import annotations

import sys
from typing import Any

IDLE_POLL_US = 100_000  # the thread's poll timeout between events (NIXL's default: 1 ms)


def wake_on_events_only(idle_poll_us: int = IDLE_POLL_US) -> None:
    """Every ``nixl_agent`` made after this call polls idle every ``idle_poll_us``."""
    from nixl._api import nixl_agent  # the interop environment's NIXL, as SGLang imports it

    bindings = sys.modules[nixl_agent.__module__].nixlBind  # what nixl_agent builds with
    make = bindings.nixlAgent
    if getattr(make, "idle_poll_us", None) is not None:
        return  # already done in this process

    def agent(name: str, config: Any) -> Any:
        config.pthrDelay = idle_poll_us
        return make(name, config)

    agent.idle_poll_us = idle_poll_us  # type: ignore[attr-defined]
    bindings.nixlAgent = agent
