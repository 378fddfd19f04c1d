"""Issue 29: a fleet behind the real smg (1.13.0) — two workers (their HTTP API fronts, the
native protocol), two reference decode peers, one smg — and what the router's clients see
when a worker is killed, drained for a rolling update, or holds a prefix.

One fleet serves the module (start-ups are most of the cost); each test leaves both workers
registered and healthy. smg runs with the settings docs/deploy.md recommends for a fleet:
health checks every ``HEALTH_INTERVAL_S`` with one failure to eject and one success to
re-admit, retries that outlast that window, the prefill policy ``cache_aware``; the workers
with ``daemon.drain_min_s``. smg's health window is ``interval × failure threshold + probe
timeout`` (smg marks a worker not ready after that many consecutive failed probes): the tests
prove the ejection came within it from smg's own log (the one probe that failed before smg
marked the worker not ready, and what that probe got), not by a stopwatch on their own polling
of smg, which a loaded machine can make late. The drain's floor and smg's retries leave room
for smg's probe itself to be seconds late. Each test prints its numbers (``pytest -s``): they
are docs/deploy.md's failure matrix."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator

import pytest

from tests.checkpoints import add_byte_tokenizer, make_checkpoint
from tests.polling import wait_until
from tests.smg.conftest import Prefill, Stack, http, require_smg
from tests.smg.load import Load, Sent

HEALTH_INTERVAL_S = 1
HEALTH_TIMEOUT_S = 1
HEALTH_WINDOW_S = HEALTH_INTERVAL_S * 1 + HEALTH_TIMEOUT_S  # failure threshold 1
NUM_CLIENTS = 3
# Room for smg's probe to come late (a loaded node): past the health window, the drained worker
# stays up answering 503 and smg's retries keep trying for this long.
LATE_PROBE_S = 6
# The worker stays up answering 503 for a health window and a late probe after a drain begins.
WORKER_SETTINGS = (
    "daemon.drain_timeout_s=30",
    f"daemon.drain_min_s={HEALTH_WINDOW_S + LATE_PROBE_S}",
)
# smg's retries (8 attempts, 200 ms doubling up to 2 s: 9 s of backoff) outlast that too.
RETRIES = (
    *("--retry-max-retries", "8", "--retry-initial-backoff-ms", "200"),
    *("--retry-backoff-multiplier", "2", "--retry-max-backoff-ms", "2000"),
)
SHARED_PREFIX = "You are the fleet's assistant. Answer in one short line please. "  # 64 tokens


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_smg()
    tmp_path = tmp_path_factory.mktemp("fleet")
    checkpoint = add_byte_tokenizer(make_checkpoint("llama", tmp_path / "llama"))
    stack = Stack(tmp_path, checkpoint, "native")
    for _ in range(2):
        stack.start_prefill(*WORKER_SETTINGS)
    stack.start_decode()
    stack.start_decode()
    stack.start_router(
        *("--prefill-policy", "cache_aware", "--decode-policy", "round_robin"),
        *("--health-check-interval-secs", str(HEALTH_INTERVAL_S)),
        *("--health-check-timeout-secs", str(HEALTH_TIMEOUT_S)),
        *("--health-failure-threshold", "1", "--health-success-threshold", "1"),
        *RETRIES,
    )
    yield stack
    for child in stack.children:
        child.kill()


def test_shared_prefix_requests_go_to_the_worker_holding_it(fleet: Stack) -> None:
    """smg's cache-aware policy keeps a tree of the texts it routed to each worker; a request
    whose text matches more than ``--cache-threshold`` (0.3) of one goes to that worker, whose
    prefix cache then serves the shared pages (its hit rate in /metrics)."""
    before = {p.url: _served(p) for p in fleet.prefills}
    for i in range(6):
        status, body = fleet.generate(_text(f"{SHARED_PREFIX}Question {i}?"))
        assert status == 200, body
    served = {p.url: _served(p) - before[p.url] for p in fleet.prefills}
    [holder] = [p for p in fleet.prefills if served[p.url] > 0]
    assert served[holder.url] == 6, served  # all six on the worker holding the prefix
    hits = holder.metric("prefill_worker_prefix_cache_hits_total")
    queries = holder.metric("prefill_worker_prefix_cache_queries_total")
    assert hits >= 5 * len(SHARED_PREFIX), (hits, queries)  # 64 tokens: 16 whole pages
    print(f"\ncache-aware: 6/6 on one worker, prefix hit rate {hits / queries:.2f}")


def test_a_drained_worker_rolls_over_with_no_client_error(fleet: Stack) -> None:
    """A rolling update: POST /drain (the preStop hook), SIGTERM, a new process on the same
    ports. The draining worker answers /health and new requests 503; smg retries a 503 on the
    other worker (``retry.rs``: 503 is retryable) and its health check stops sending there.
    Zero client errors; once smg has seen the drain, smg sends the worker nothing."""
    target = fleet.prefills[0]
    spare = fleet.start_spare(target, *WORKER_SETTINGS)
    load = Load(fleet.generate, NUM_CLIENTS).start()
    try:
        _wait_serving(target)
        retries = _router_metric(fleet, "smg_worker_retries_total{")
        smg_log = _SmgLog(fleet)
        drained_at = time.monotonic()
        assert target.worker.http("/drain", method="POST")[0] == 202
        ejected_at = _wait_health(fleet, target, False)
        # smg's first failed probe after the drain got the drain's 503 and ejected the worker
        assert smg_log.probes_until_ejected(target) == ["503 Service Unavailable"]
        attempts = _router_attempts(fleet, target)
        assert attempts > 0
        wait_until(lambda: load.num_ok_since(ejected_at) >= 6, 60, "requests on the other")
        assert _router_attempts(fleet, target) == attempts  # nothing sent to it since
        if target.worker.proc.poll() is None:  # the drain may have ended it already
            target.worker.proc.send_signal(signal.SIGTERM)
        assert fleet.wait_exit(target, 60) == 0
        ready_at = fleet.swap_in(target, spare)
        readmitted_at = _wait_health(fleet, target, True)
        wait_until(lambda: _served(target) >= 1, 60, "the new process to be used")
    finally:
        outcomes = load.stop()
    errors = [s for s in outcomes if not s.is_ok]
    assert errors == [], errors
    retried = _router_metric(fleet, "smg_worker_retries_total{") - retries
    print(
        f"\ndrain: {len(outcomes)} requests, 0 errors, {retried:.0f} retries by smg, "
        f"ejected {ejected_at - drained_at:.1f} s after /drain, "
        f"re-admitted {readmitted_at - ready_at:.1f} s after ready"
    )


def test_a_killed_worker_fails_only_its_requests_and_comes_back(fleet: Stack) -> None:
    """SIGKILL under load: only requests in flight at the kill may fail; smg's health check
    ejects the worker within its window and sends it nothing after; the worker restarted on
    its ports is re-admitted and used again."""
    target = fleet.prefills[1]
    spare = fleet.start_spare(target, *WORKER_SETTINGS)
    load = Load(fleet.generate, NUM_CLIENTS).start()
    try:
        _wait_serving(target)
        smg_log = _SmgLog(fleet)
        killed_at = time.monotonic()
        target.worker.proc.kill()
        fleet.wait_exit(target, 30)
        ejected_at = _wait_health(fleet, target, False)
        # smg's first failed probe after the kill got no answer and ejected the worker
        assert smg_log.probes_until_ejected(target) == ["no HTTP answer"]
        attempts = _router_attempts(fleet, target)
        assert attempts > 0
        wait_until(lambda: load.num_ok_since(ejected_at) >= 6, 60, "requests on the other")
        assert _router_attempts(fleet, target) == attempts  # nothing sent to it since
        ready_at = fleet.swap_in(target, spare)
        readmitted_at = _wait_health(fleet, target, True)
        wait_until(lambda: _served(target) >= 1, 60, "the restarted worker to be used")
    finally:
        outcomes = load.stop()
    errors = [s for s in outcomes if not s.is_ok]
    assert all(s.was_in_flight(killed_at) for s in errors), _late(errors, killed_at)
    assert len(errors) <= NUM_CLIENTS
    in_flight = sum(1 for s in outcomes if s.was_in_flight(killed_at))
    print(
        f"\nkill: {len(outcomes)} requests, {in_flight} in flight at the kill, "
        f"{len(errors)} errors (all in flight at the kill), "
        f"ejected {ejected_at - killed_at:.1f} s after the kill, "
        f"re-admitted {readmitted_at - ready_at:.1f} s after ready"
    )


def _text(text: str) -> dict[str, object]:
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}


def _served(prefill: Prefill) -> float:
    return prefill.metric('prefill_worker_requests_total{reason="ok"')


def _wait_serving(prefill: Prefill) -> None:
    """The load reaches this worker (smg's min-load pick spreads distinct prompts)."""
    start = _served(prefill)
    wait_until(lambda: _served(prefill) >= start + 3, 60, f"load on {prefill.url}")


def _wait_health(stack: Stack, prefill: Prefill, is_healthy: bool) -> float:
    """When smg's /workers first shows the worker so."""
    wait_until(lambda: _is_healthy(stack, prefill) == is_healthy, 60, f"healthy={is_healthy}")
    return time.monotonic()


def _is_healthy(stack: Stack, prefill: Prefill) -> bool:
    _, body = http(f"{stack.router}/workers", timeout_s=2)
    [worker] = [w for w in body["workers"] if w["url"] == prefill.url]
    return bool(worker["is_healthy"])


class _SmgLog:
    """smg's log from now on (``--log-level info``): what its health probes of a worker got."""

    _ANSI = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, stack: Stack) -> None:
        [self._child] = [c for c in stack.children if c.name == "smg"]
        self._offset = len(self._read())

    def probes_until_ejected(self, prefill: Prefill) -> list[str]:
        """What each failed probe of the worker got (an HTTP status such as ``503 Service
        Unavailable``, or ``no HTTP answer``: a refused or reset connection, a timeout), in
        order, up to smg's ``Ready`` to ``NotReady`` transition of it (waited for: smg's
        /workers can show the change before its log is written)."""
        transition = f"worker_url={prefill.url} old=Ready new=NotReady"
        wait_until(lambda: transition in self._read()[self._offset :], 60, transition)
        found = []
        for line in self._read()[self._offset :].splitlines():
            if f"status for {prefill.url}/health: " in line:  # an HTTP answer other than 2xx
                found.append(line.rpartition("/health: ")[2].strip())
            elif f"check failed for {prefill.url}/health: " in line:  # no HTTP answer
                found.append("no HTTP answer")
            elif transition in line:
                break
        return found

    def _read(self) -> str:
        return self._ANSI.sub("", self._child.log_path.read_text(errors="replace"))


def _router_attempts(stack: Stack, prefill: Prefill) -> float:
    """Requests smg has sent the worker: its circuit breaker's outcomes (every attempt's)."""
    return _router_metric(stack, "smg_worker_cb_outcomes_total{", f'worker="{prefill.url}"')


def _router_metric(stack: Stack, prefix: str, label: str = "") -> float:
    """The sum of smg's Prometheus samples that start with ``prefix`` and hold ``label``."""
    _, text = http(f"http://127.0.0.1:{stack.router_metrics_port}/metrics", timeout_s=5)
    lines = [s for s in str(text).splitlines() if s.startswith(prefix) and label in s]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def _late(errors: list[Sent], at: float) -> list[tuple[float, float, int, str]]:
    return [(s.sent_at - at, s.ended_at - at, s.status, s.answer) for s in errors]
