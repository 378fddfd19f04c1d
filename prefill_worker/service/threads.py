"""The supervision of the worker's edge threads: which have stopped.

An edge thread (the router ingress's I/O, the HTTP servers, SGLang's control socket, the
KV-event publisher, the NIXL transfer threads) serves peers the engine never sees; if one
stops while the engine turns, the engine's liveness says nothing of it. So the daemon runs
each start-up step that starts such a thread inside ``ThreadWatch.step``, which records the
threads of ``EDGE_THREADS`` that appear meanwhile, and ``stopped`` names those no longer alive.
``Health`` turns any of them into ``/livez`` and ``/readyz`` 503 and the systemd watchdog
stops (docs/architecture.md, "One owner per policy"). Threads are matched by name and by
appearing during the step, so another worker's threads in the same process (tests) are not
mistaken for this one's, and a thread that ends for any reason is found the same way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

# The long-lived I/O threads of the worker, by the names their components give them; with
# them the threads that own the NIXL agents and post every KV write (a dead one would leave
# every transfer waiting while the engine turns).
EDGE_THREADS = frozenset(
    {
        "ingress-io",
        "http",
        "http-api",
        "sglang-http",
        "sglang-control",
        "kv-events",
        "nixl-push",
        "nixl-push-sglang",
        "nixl-push-vllm",
    }
)


class ThreadWatch:
    """Edge threads recorded per start-up step; ``stopped`` is safe from any thread."""

    def __init__(self, names: frozenset[str] = EDGE_THREADS) -> None:
        self._names = names
        self._threads: list[tuple[str, threading.Thread]] = []  # (step, thread)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Record the edge threads that the code in the ``with`` block starts."""
        before = set(threading.enumerate())
        try:
            yield
        finally:
            started = [t for t in threading.enumerate() if t not in before]
            with self._lock:
                self._threads += [(name, t) for t in started if t.name in self._names]

    def watched(self) -> list[str]:
        """``step/thread`` for every thread under watch."""
        with self._lock:
            return [f"{step}/{thread.name}" for step, thread in self._threads]

    def stopped(self) -> list[str]:
        """``step/thread`` for every watched thread that is no longer alive."""
        with self._lock:
            return [f"{s}/{t.name}" for s, t in self._threads if not t.is_alive()]
