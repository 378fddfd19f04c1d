"""An aiohttp application served on an event-loop thread of its own (uvloop where installed).

The worker's three HTTP servers (metrics/health, the SGLang-compatible API front, SGLang's
bootstrap routes) each run one: ``start`` binds and returns the port (OSError here when the
bind fails), ``stop`` closes the listener and gives requests in flight ``STOP_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 2.0  # requests still in flight at stop get this long, then are cut


class ThreadedSite:
    """One aiohttp app on one daemon thread; ``loop`` is None unless it is serving."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, app: web.Application, host: str, port: int, **runner_options: Any) -> int:
        """Serve ``app`` at host:port (0 picks one); returns the bound port."""
        loop = self.loop = _new_loop()
        self._thread = threading.Thread(
            target=self._run_forever, args=(loop,), name=self._thread_name, daemon=True
        )
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(
                self._serve(app, host, port, runner_options), loop
            ).result()
        except BaseException:
            self.stop()
            raise

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Close the listener and the loop; a loop whose thread has already stopped (see
        ``_run_forever``) is closed without waiting on it."""
        loop, thread, self.loop = self.loop, self._thread, None
        if loop is None or thread is None:
            return
        if not thread.is_alive():
            loop.close()
            return
        try:
            if self._runner is not None:
                cleanup = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop)
                cleanup.result(timeout=STOP_TIMEOUT_S + 1.0)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            if not thread.is_alive():
                loop.close()

    def _run_forever(self, loop: asyncio.AbstractEventLoop) -> None:
        """The thread's work. A handler's ``Exception`` is aiohttp's to answer (500); only a
        ``BaseException`` stops the loop, and then the thread: logged here, and the daemon's
        thread watch makes the worker not live."""
        try:
            loop.run_forever()
        except BaseException:
            log.exception("the %s event loop stopped", self._thread_name)

    async def _serve(
        self, app: web.Application, host: str, port: int, runner_options: dict[str, Any]
    ) -> int:
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=STOP_TIMEOUT_S, **runner_options
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return int(self._runner.addresses[0][1])


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed; using the default asyncio loop")
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
