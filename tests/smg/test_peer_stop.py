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
from pathlib import Path

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
