"""The decode SDK's waiting and its optional I/O thread.

``Waiters`` wakes whoever waits for a room (or for the registration): threads blocked in
``KVReceiver.wait`` on a condition of the receiver's lock, and asyncio tasks in
``wait_async`` on a future resolved in their own loop (``call_soon_threadsafe``: the room may
end on any thread). When nothing else drives the receiver, a waiter drives it itself,
polling every ``POLL_S`` (NIXL gives no fd to wait on).

``IOThread`` drives the receiver in the background: one ``progress`` turn, then a sleep as
long as the turn says (1 ms while a room or the registration is pending), cut short by
``kick`` (a new ``want``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from prefill_worker.transfer.decode.rooms import RoomStatus

log = logging.getLogger(__name__)

POLL_S = 0.001
_Waiting = tuple[asyncio.AbstractEventLoop, asyncio.Future[RoomStatus]]


class Waiters:
    """Wakes threads and asyncio tasks waiting on the receiver; use under its lock."""

    def __init__(self, lock: threading.RLock) -> None:
        self._cond = threading.Condition(lock)
        self._futures: dict[int, list[_Waiting]] = {}

    def ended(self, room: int, status: RoomStatus) -> None:
        """A room ended: wake the threads, resolve the futures (each in its own loop)."""
        self._cond.notify_all()
        for loop, future in self._futures.pop(room, []):
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future, status)

    def changed(self) -> None:
        self._cond.notify_all()

    def wait(
        self, is_done: Callable[[], bool], timeout_s: float, drive: Callable[[], None] | None
    ) -> bool:
        """Wait (holding the lock; it is released while asleep) until ``is_done()``; False
        after ``timeout_s``. ``drive``, when given, is called every ``POLL_S``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if drive is not None:
                drive()
            if is_done():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._cond.wait(min(remaining, POLL_S) if drive is not None else remaining)

    def future_for(self, room: int) -> asyncio.Future[RoomStatus]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RoomStatus] = loop.create_future()
        self._futures.setdefault(room, []).append((loop, future))
        return future

    async def wait_future(
        self,
        future: asyncio.Future[RoomStatus],
        room: int,
        timeout_s: float | None,
        drive: Callable[[], None] | None,
    ) -> RoomStatus:
        """Await the room's future; ``drive`` (when given) every ``POLL_S`` meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not future.done():
            if drive is not None:
                drive()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                self._forget(room, future)
                raise TimeoutError(f"room {room} still pending after {timeout_s:g} s")
            step = POLL_S if drive is not None else remaining
            if remaining is not None and step is not None:
                step = min(step, remaining)
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(future), step)
        return future.result()

    def _forget(self, room: int, future: asyncio.Future[RoomStatus]) -> None:
        with self._cond:
            waiting = self._futures.get(room, [])
            self._futures[room] = [(lp, f) for lp, f in waiting if f is not future]


def _resolve(future: asyncio.Future[RoomStatus], status: RoomStatus) -> None:
    if not future.done():
        future.set_result(status)


class IOThread:
    """Calls ``turn()`` again and again; sleeps as long as it returns, or until ``kick``."""

    def __init__(self, turn: Callable[[], float], name: str) -> None:
        self._turn = turn
        self._kicked = threading.Event()
        self._is_stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._kicked.set()

    def stop(self) -> None:
        self._is_stopping = True
        self._kicked.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _main(self) -> None:
        while not self._is_stopping:
            try:
                sleep_s = self._turn()
            except Exception:  # one bad turn must not end the receiver's I/O
                log.exception("kv receiver I/O turn failed")
                sleep_s = 0.1
            self._kicked.wait(sleep_s)
            self._kicked.clear()
