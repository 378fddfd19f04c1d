"""No edge thread dies silently: each one's work (and the NIXL transfer thread's) is killed by
an exception injected through the component's public parameters (an observer or callback that
raises, the event loop a site serves on), and the daemon's thread watch turns the stopped
thread into ``/livez`` and ``/readyz`` 503. The last test runs the whole daemon: its stopped
ingress thread is not live and not ready at once (before: both kept answering 200 while no
router got a reply)."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from aiohttp import web

from prefill_worker.aio_site import ThreadedSite
from prefill_worker.ingress.zmq_front import Ingress
from prefill_worker.kv_events.publisher import KVEventPublisher
from prefill_worker.load import LoadSnapshot
from prefill_worker.service.http import Health
from prefill_worker.service.threads import ThreadWatch
from prefill_worker.transfer.nixl.push_thread import PushThread
from prefill_worker.transfer.sglang.control import ControlSocket
from tests.integration.daemon.conftest import free_port, wait_until
from tests.integration.daemon.test_readiness import tiny_daemon
from tests.patience import patient


class Injected(RuntimeError):
    """The exception a test puts into a thread's work."""


def _raise(*args: object) -> None:
    raise Injected("injected into the thread's work")


def _watched(step: str, start: Callable[[], object]) -> tuple[ThreadWatch, Health]:
    watch = ThreadWatch()
    with watch.step(step):
        start()
    health = Health(livez_stale_s=60.0)
    health.watch_threads(watch.stopped)
    assert watch.watched() and health.is_live(), watch.watched()
    return watch, health


def _assert_stops(health: Health, name: str) -> None:
    wait_until(lambda: not health.is_live(), 5, f"{name} not live")
    assert name in health.liveness().reason and health.stopped_threads() == [name]


class _RaisingIngressObserver:
    def on_reject(self, code: str) -> None:
        return None

    on_malformed = _raise

    def on_unroutable(self) -> None:
        return None


def test_a_killed_ingress_thread_is_not_live() -> None:
    ingress = Ingress(
        "tcp://127.0.0.1:0",
        queue.Queue(),
        LoadSnapshot,
        vocab_size=100,
        max_prompt_tokens=16,
        max_pool_tokens=64,
        max_inflight=8,
        observer=_RaisingIngressObserver(),
    )
    _, health = _watched("ingress", ingress.start)
    ctx = zmq.Context()
    router = ctx.socket(zmq.DEALER)
    try:
        router.connect(ingress.endpoint)
        router.send(b"not msgpack")
        _assert_stops(health, "ingress/ingress-io")
        assert isinstance(ingress.error, Injected)
    finally:
        router.close(linger=0)
        ctx.term()
        ingress.close()


class _RaisingKVEventsObserver:
    """Raises on a publish once armed: the publisher's first batch goes out as its thread
    starts, before the watch could see a thread that died at once."""

    armed = False

    def on_published(self, *args: object) -> None:
        if self.armed:
            _raise()

    def on_dropped(self, reason: str, num_events: int) -> None:
        return None

    def on_replay(self, outcome: str) -> None:
        return None


def test_a_killed_kv_events_thread_is_not_live() -> None:
    observer = _RaisingKVEventsObserver()
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", observer=observer)
    try:
        _, health = _watched("kv events", publisher.start)
        observer.armed = True
        publisher.all_cleared()
        _assert_stops(health, "kv events/kv-events")
    finally:
        publisher.close()


def test_a_killed_sglang_control_thread_is_not_live() -> None:
    control = ControlSocket("127.0.0.1", 0, 1 << 20, on_message=_raise)
    _, health = _watched("transfer", control.start)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{control.endpoint.port}")
        push.send_multipart([b"ABORT", b"1", b"127.0.0.1", b"9"])
        _assert_stops(health, "transfer/sglang-control")
    finally:
        push.close(linger=0)
        ctx.term()
        control.close()


def test_a_killed_transfer_thread_is_not_live() -> None:
    """The thread that owns a NIXL agent (every call and write goes through it) dies when the
    callback it tells of changes raises; no agent is needed for a control call."""
    threads: list[PushThread] = []
    _, health = _watched(
        "transfer", lambda: threads.append(PushThread(None, "nixl-push", on_change=_raise))
    )
    threads[0].run_later(lambda: None)
    _assert_stops(health, "transfer/nixl-push")
    threads[0].close()


@pytest.fixture
def sites() -> Iterator[list[ThreadedSite]]:
    started: list[ThreadedSite] = []
    yield started
    for site in started:
        site.stop()


@pytest.mark.parametrize("name", ["http", "http-api", "sglang-http"])
def test_a_killed_event_loop_thread_is_not_live(name: str, sites: list[ThreadedSite]) -> None:
    """An ``Exception`` in a handler is aiohttp's to answer (500) and never stops the loop;
    what can stop it is a ``BaseException`` reaching ``run_forever``, injected here."""
    site = ThreadedSite(name)
    sites.append(site)
    _, health = _watched(name, lambda: site.start(web.Application(), "127.0.0.1", 0))
    assert site.loop is not None

    def exit_loop() -> None:
        raise SystemExit("injected into the loop")

    site.loop.call_soon_threadsafe(exit_loop)
    _assert_stops(health, f"{name}/{name}")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}{path}", timeout=patient(5)
        ) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:  # not listening yet
        return 0, ""


def test_the_daemon_is_not_live_once_its_ingress_thread_stops(checkpoint: Path) -> None:
    import threading

    http_port = free_port()
    every_edge = (
        "transfer.protocol=both",
        f"transfer.sglang_bootstrap_bind=127.0.0.1:{free_port()}",
        "http_api.enabled=true",
        f"http_api.bind=127.0.0.1:{free_port()}",
        "kv_events.enabled=true",
        "kv_events.publish_bind=tcp://127.0.0.1:0",
        "kv_events.replay_bind=tcp://127.0.0.1:0",
    )
    daemon = tiny_daemon(checkpoint, http_port, free_port(), free_port(), *every_edge)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    try:
        wait_until(lambda: _get(http_port, "/readyz")[0] == 200, 60, "ready")
        assert sorted(daemon.threads.watched()) == [
            "http api/http-api",
            "http/http",
            "ingress/ingress-io",
            "kv events/kv-events",
            "transfer/nixl-push",
            "transfer/nixl-push-sglang",
            "transfer/sglang-control",
            "transfer/sglang-http",
        ]
        assert _get(http_port, "/livez")[0] == 200
        daemon.ingress.close()  # its I/O thread stops, as if its loop had raised
        wait_until(lambda: not daemon.ingress.is_alive, 5, "ingress thread gone")
        code, text = _get(http_port, "/livez")
        assert code == 503 and "ingress/ingress-io" in text, text
        code, text = _get(http_port, "/readyz")
        body = json.loads(text)
        assert code == 503 and body["status"] == "failed", body
        assert body["stopped"] == ["ingress/ingress-io"]
    finally:
        daemon.request_drain()
        thread.join(timeout=patient(30))
    assert codes == [0]
