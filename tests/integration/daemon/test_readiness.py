"""Readiness follows start-up: /readyz answers 503 while the model loads, 200 once serving,
503 again while draining; POST /drain ends the daemon with exit 0. In-process, with the model
builder passed in: one that holds the load back by a gate (so the 503 is observed for certain),
runners that fail or never return."""

from __future__ import annotations

import threading
from pathlib import Path

from prefill_worker.model import build
from prefill_worker.service.config import load_config
from prefill_worker.service.daemon import Daemon, ModelBuilder
from tests.integration.daemon.conftest import ROOT, free_port, wait_until
from tests.patience import patient

# For runners that break, hang or hold on a forward: a warm-up forward would meet it first
# and stop (or hold) start-up.
NO_WARM_UP = "scheduler.warmup_tokens=0"


def tiny_daemon(
    checkpoint: Path,
    http_port: int,
    ingress_port: int,
    bootstrap_port: int,
    *extra: str,
    build_model: ModelBuilder = build,
) -> Daemon:
    """An in-process daemon on the tiny test config (signals stay with pytest)."""
    config = load_config(
        ROOT / "configs" / "tiny-test.yaml",
        env={},
        overrides=[
            f"model.path={checkpoint}",
            f"metrics.bind=127.0.0.1:{http_port}",
            f"ingress.bind=tcp://127.0.0.1:{ingress_port}",
            f"transfer.bootstrap_bind=tcp://127.0.0.1:{bootstrap_port}",
            *extra,
        ],
    )
    return Daemon(config, env={}, build_model=build_model)


def test_readyz_503_until_loaded_then_200_then_drain(checkpoint: Path, tmp_path: Path) -> None:
    gate = threading.Event()

    def gated_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(patient(60))
        return build(*args, **kwargs)

    http_port = free_port()
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-token\n")
    daemon = tiny_daemon(
        checkpoint,
        http_port,
        free_port(),
        free_port(),
        f"metrics.admin_token_file={token_file}",
        build_model=gated_build,
    )
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    try:
        health = daemon.health
        wait_until(lambda: not gate.is_set() and _get(http_port, "/readyz") == 503, 30, "503")
        assert not health.is_ready
        gate.set()
        wait_until(lambda: _get(http_port, "/readyz") == 200, 60, "ready")
        assert _get(http_port, "/livez") == 200
        assert _get(http_port, "/drain", "POST") == 403  # admin route: the token is needed
        assert _get(http_port, "/drain", "POST", "Bearer wrong") == 403
        assert health.is_ready and not health.is_draining
        assert _get(http_port, "/drain", "POST", "Bearer s3cret-token") == 202
        thread.join(timeout=patient(30))
        assert codes == [0]
    finally:
        gate.set()
        daemon.request_drain()
        thread.join(timeout=patient(30))


def _get(port: int, path: str, method: str = "GET", authorization: str | None = None) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=patient(5)) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class _BrokenRunner:
    def run(self, plan):  # type: ignore[no-untyped-def]
        raise RuntimeError("device fell over")


def test_fatal_engine_error_fails_in_flight_and_exits_70(checkpoint: Path, router_factory) -> None:
    from prefill_worker.request import OutcomeStatus
    from tests.checkpoints import prompt
    from tests.integration.daemon.conftest import Decode

    def broken_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        _, kv_cache, info = build(*args, **kwargs)
        return _BrokenRunner(), kv_cache, info

    ingress_port, bootstrap_port = free_port(), free_port()
    ingress = f"tcp://127.0.0.1:{ingress_port}"
    bootstrap = f"tcp://127.0.0.1:{bootstrap_port}"
    daemon = tiny_daemon(
        checkpoint,
        free_port(),
        ingress_port,
        bootstrap_port,
        NO_WARM_UP,
        build_model=broken_build,
    )
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    try:
        wait_until(lambda: daemon.health.is_ready, 60, "ready")
        decode = Decode(bootstrap)
        decode.want(7, 12)
        result = router_factory(ingress).prefill(prompt(12, seed=7), 7)
        assert result.status is OutcomeStatus.FAILED
        assert result.reason.value == "engine_error" and "device fell over" in (result.error or "")
        thread.join(timeout=patient(30))
        assert codes == [70]
        decode.close()
    finally:
        daemon.request_drain()
        thread.join(timeout=patient(30))


def test_second_signal_leaves_a_stuck_forward(checkpoint: Path, router_factory) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tests.checkpoints import prompt
    from tests.integration.daemon.conftest import Decode

    release, entered = threading.Event(), threading.Event()

    class StuckRunner:
        def run(self, plan):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(patient(120))
            raise RuntimeError("released at the end of the test")

    def stuck_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        _, kv_cache, info = build(*args, **kwargs)
        return StuckRunner(), kv_cache, info

    ingress_port, bootstrap_port = free_port(), free_port()
    daemon = tiny_daemon(
        checkpoint, free_port(), ingress_port, bootstrap_port, NO_WARM_UP, build_model=stuck_build
    )
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    router = None
    try:
        wait_until(lambda: daemon.health.is_ready, 60, "ready")
        decode = Decode(f"tcp://127.0.0.1:{bootstrap_port}")
        decode.want(3, 12)
        router = router_factory(f"tcp://127.0.0.1:{ingress_port}")
        with ThreadPoolExecutor(1) as pool:
            # Never answered (the forced stop leaves it): the pool waits out this timeout.
            pool.submit(router.prefill, prompt(12, seed=3), 3, timeout_s=1.0)
            assert entered.wait(patient(30)), "the forward never started"
            daemon.on_stop_signal()
            wait_until(lambda: daemon.health.is_draining, 10, "draining")
            daemon.on_stop_signal()
            thread.join(timeout=patient(30))
            assert codes == [1]
        decode.close()
    finally:
        release.set()
        daemon.request_drain()
        thread.join(timeout=patient(30))


def test_livez_tells_a_busy_forward_from_a_stuck_one(checkpoint: Path, router_factory) -> None:
    """A forward held on an event: /livez is 200 ("busy") once the loop has been silent past
    livez_stale_s, 503 ("stuck") once the forward passes its bound (here the floor, as no
    forward was timed before), and 200 again when it ends; the request then succeeds. The
    floor (15 s) is the room the test has to see "busy" in: the first answer that is not
    "live" must say so however late this process is scheduled (the test's wait for "stuck"
    then lasts the floor; 6 s before, which a stall of 5 s on a loaded machine could miss)."""
    from concurrent.futures import ThreadPoolExecutor

    from prefill_worker.request import OutcomeStatus
    from tests.checkpoints import prompt
    from tests.integration.daemon.conftest import Decode

    release, entered = threading.Event(), threading.Event()

    class HeldRunner:
        def __init__(self, runner) -> None:  # type: ignore[no-untyped-def]
            self._runner = runner

        def run(self, plan):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(patient(120))
            return self._runner.run(plan)

    def held_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        runner, kv_cache, info = build(*args, **kwargs)
        return HeldRunner(runner), kv_cache, info

    http_port, ingress_port, bootstrap_port = free_port(), free_port(), free_port()
    daemon = tiny_daemon(
        checkpoint,
        http_port,
        ingress_port,
        bootstrap_port,
        "metrics.livez_stale_s=0.3",
        "metrics.livez_forward_floor_s=15",
        NO_WARM_UP,
        # While the forward is stuck the worker sends no heartbeats: the decode waits longer.
        "transfer.peer_timeout_s=60",
        build_model=held_build,
    )
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    try:
        wait_until(lambda: daemon.health.is_ready, 60, "ready")
        decode = Decode(f"tcp://127.0.0.1:{bootstrap_port}", peer_timeout_s=60)
        decode.want(5, 12)
        router = router_factory(f"tcp://127.0.0.1:{ingress_port}")
        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(router.prefill, prompt(12, seed=5), 5, timeout_s=60.0)
            assert entered.wait(patient(30)), "the forward never started"
            seen = [(200, "live\n")]

            def is_silent() -> bool:  # the first answer that is not "live" is the one checked
                seen.append(_livez(http_port))
                return seen[-1] != seen[0]

            wait_until(is_silent, 30, "the loop to go silent")
            status, body = seen[-1]
            assert (status, body[:5]) == (200, "busy:"), body
            wait_until(lambda: _livez(http_port)[0] == 503, 60, "the forward to pass its bound")
            assert "stuck: a forward of 12 tokens" in _livez(http_port)[1]
            release.set()
            decode.wait([5])
            assert result.result(timeout=patient(60)).status is OutcomeStatus.OK
        assert _livez(http_port) == (200, "live\n")
        decode.close()
    finally:
        release.set()
        daemon.request_drain()
        thread.join(timeout=patient(30))
    assert codes == [0]


def _livez(port: int) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/livez", timeout=patient(5)
        ) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
