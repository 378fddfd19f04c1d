"""A child process for ``test_peer_stop.py``: the reference decode peer's serve loop
(``peer_http.serve_http``) on its main thread, idle, with a SIGTERM handler that runs longer
than the loop's wait for a job, as the peer's own handler may on a loaded machine (the GIL
shared with SGLang's threads). Each signal is sent to the main thread while the loop turns;
the third one sets the stop. Prints ``stopped`` once the loop has returned; a loop still
there after ``HANG_S`` is a hang: every thread's stack, exit 1."""

from __future__ import annotations

import faulthandler
import signal
import threading
import time

from prefill_worker.testing.peer_http import PeerHttp, serve_http

NUM_SIGNALS = 3
HANDLER_S = 0.05  # the loop waits 2 ms for a job: the handler outlasts that wait
HANG_S = 10.0  # still here then: every thread's stack is printed and the probe exits 1


class IdlePeer:
    """What ``serve_http`` asks of a ``DecodePeer`` with nothing to do."""

    is_decoding = False

    def __init__(self) -> None:
        self.stepped = threading.Event()

    def step(self) -> list[object]:
        self.stepped.set()
        return []


def main() -> None:
    stop, handled = threading.Event(), threading.Event()
    num_handled = 0

    def on_sigterm(*_: object) -> None:
        nonlocal num_handled
        time.sleep(HANDLER_S)
        num_handled += 1
        if num_handled == NUM_SIGNALS:
            stop.set()
        handled.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    peer = IdlePeer()
    front = PeerHttp("127.0.0.1:0", None, None, None, (), lambda host, port: None)  # type: ignore[arg-type]
    main_id = threading.main_thread().ident
    assert main_id is not None

    def signal_the_loop() -> None:
        for _ in range(NUM_SIGNALS):
            peer.stepped.clear()
            peer.stepped.wait()  # the loop turns: the main thread waits for a job
            handled.clear()
            signal.pthread_kill(main_id, signal.SIGTERM)
            handled.wait()

    threading.Thread(target=signal_the_loop, daemon=True).start()
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    serve_http(peer, front, stop)  # type: ignore[arg-type]
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
