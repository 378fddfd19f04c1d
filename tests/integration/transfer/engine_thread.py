"""An engine running on its own thread, as the daemon runs it, for tests that drive a real
engine over a real transfer backend: started, then stopped, shut down and its pools checked
whole, whatever the test did."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefill_worker.inbox import Inbox
from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.scheduler import Engine


@contextmanager
def engine_thread(
    engine: Engine, pools: tuple[PagePool, AuxPool], *closers: Callable[[], None]
) -> Iterator[Inbox]:
    """The engine's inbox while it runs; on exit: stop, shut down, ``closers`` in order (the
    decode, the backend), then every page and aux row must be back."""
    inbox, stop = Inbox(), threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop, inbox), daemon=True)
    thread.start()
    try:
        yield inbox
    finally:
        stop.set()
        inbox.wake()
        thread.join(30)
        engine.shutdown()
        for close in closers:
            close()
        for pool in pools:
            pool.check_integrity()
