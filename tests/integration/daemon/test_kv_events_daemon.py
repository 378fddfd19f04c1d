"""The daemon's KV-event wiring, in process: with ``kv_events.enabled`` it builds the publisher
before the engine, holds it as ``cache_events`` (what the prefix cache is handed), announces both
endpoints in ``/readyz``, counts in ``/metrics``, and closes the sockets after a drain. Off (the
default), the sink drops events and nothing is bound."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import msgspec
import zmq

from prefill_worker.kv.cache_events import NullCacheEvents
from prefill_worker.kv_events import KVEventPublisher
from prefill_worker.kv_events.wire import END_OF_REPLAY_SEQ, seq_frame
from prefill_worker.service.config import load_config
from prefill_worker.service.daemon import Daemon
from tests.integration.daemon.conftest import ROOT, free_port, wait_until
from tests.patience import patient

CLEARED = {"type": "AllBlocksCleared"}


def tiny_config(checkpoint: Path, http_port: int, *extra: str):  # type: ignore[no-untyped-def]
    return load_config(
        ROOT / "configs" / "tiny-test.yaml",
        env={},
        overrides=[f"model.path={checkpoint}", f"metrics.bind=127.0.0.1:{http_port}", *extra],
    )


def http_get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=patient(5)) as response:
        return response.read().decode()


def test_events_off_by_default(checkpoint: Path) -> None:
    daemon = Daemon(tiny_config(checkpoint, free_port()), env={})
    assert isinstance(daemon.cache_events, NullCacheEvents)


def test_daemon_publishes_announces_and_closes(checkpoint: Path) -> None:
    http_port = free_port()
    config = tiny_config(
        checkpoint,
        http_port,
        "kv_events.enabled=true",
        "kv_events.publish_bind=tcp://127.0.0.1:0",
        "kv_events.replay_bind=tcp://127.0.0.1:0",
    )
    daemon = Daemon(config, env={})
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(daemon.run()))
    thread.start()
    ctx = zmq.Context()
    try:
        wait_until(lambda: daemon.health.is_ready, 120, "ready")
        sink = daemon.cache_events
        assert isinstance(sink, KVEventPublisher)
        ready = json.loads(http_get(http_port, "/readyz"))
        assert ready["kv_events"] == sink.endpoint and sink.endpoint.startswith("tcp://127.0.0.1:")
        assert ready["kv_events_replay"] == sink.replay_endpoint

        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(ready["kv_events"])
        while not sub.poll(50):  # the engine's calls, made here (no cache calls them yet)
            sink.all_cleared()
        topic, seq, payload = sub.recv_multipart()
        _ts, events, rank = msgspec.msgpack.decode(payload)
        assert (topic, len(seq), rank) == (b"", 8, 0)
        assert events and all(event == CLEARED for event in events)
        wait_until(
            lambda: (
                "prefill_worker_kv_events_published_total 0.0"
                not in http_get(http_port, "/metrics")
            ),
            30,
            "the published counter",
        )

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(ready["kv_events_replay"])
        dealer.send_multipart([b"", seq_frame(sink.first_seq)])
        replayed = []
        while not replayed or replayed[-1][2] != END_OF_REPLAY_SEQ:
            assert dealer.poll(int(patient(10.0) * 1000)), "no replay answer"
            replayed.append(dealer.recv_multipart())
        assert replayed[0][:3] == [b"", b"", seq_frame(sink.first_seq)]
        first_batch = msgspec.msgpack.decode(replayed[0][3])[1]
        assert first_batch == [CLEARED]  # the run's opener, alone
    finally:
        ctx.destroy(linger=0)
        daemon.request_drain()
        thread.join(timeout=patient(120))
    assert codes == [0]
    with zmq.Context() as probe_ctx:  # both sockets closed: their ports are free to bind
        for endpoint in (ready["kv_events"], ready["kv_events_replay"]):
            probe = probe_ctx.socket(zmq.PUB)
            probe.bind(endpoint)
            probe.close(linger=0)
