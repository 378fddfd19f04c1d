"""The reference decode peer stops when asked, whatever its signal handler costs.

CI saw the SGLang-mode peer still running 30 s after SIGTERM, and an open request then got no
503: the serve loop, on the main thread, waited for jobs with a timed ``SimpleQueue.get``.
CPython 3.11's ``SimpleQueue.get(timeout=...)``, interrupted by a signal whose handler runs
past the timeout, then waits for the next ``put`` with no timeout at all, so the loop never
saw its stop. The peer's end to end stop with a request open is
``test_smg_router.py::test_the_decode_peer_exits_0_on_sigterm_with_a_request_open``."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from prefill_worker.ingress.validate import Limits
from prefill_worker.testing.peer_http import PeerHttp
from tests.polling import wait_until
from tests.smg.conftest import http

ROOT = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_S = 60.0  # imports and the probe's own 10 s hang watchdog included


def test_the_serve_loop_stops_when_a_slow_signal_handler_interrupts_its_wait() -> None:
    args = [sys.executable, "-m", "tests.smg.stop_probe"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the serve loop missed its stop: {out.decode()}") from None
    assert proc.returncode == 0, out.decode()
    assert out.decode().splitlines()[-1] == "stopped", out.decode()


def test_a_request_still_queued_when_the_http_face_stops_gets_a_503() -> None:
    """The peer's thread answers the requests it took as it stops; one that reached the queue
    after its last look (or that it never took) is answered by the face's own stop."""
    limits = Limits(vocab_size=256, max_prompt_tokens=64, max_pool_tokens=1024)
    front = PeerHttp("127.0.0.1:0", None, None, limits, (), lambda host, port: f"{host}:{port}")  # type: ignore[arg-type]
    port = front.start()
    where = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}
    answers: list[tuple[int, object]] = []
    url = f"http://127.0.0.1:{port}/generate"
    asker = threading.Thread(
        target=lambda: answers.append(http(url, {"input_ids": [1, 2], **where}))
    )
    asker.start()
    wait_until(lambda: front.jobs.qsize() == 1, 10, "the request queued")
    front.stop()  # no peer thread ever takes it
    asker.join(30)
    assert answers and answers[0][0] == 503, answers
