"""The SGLang backend's edges without SGLang: its bootstrap routes answer as SGLang's bootstrap
server does, and a decode that sends what it should not (garbage, a registration this worker
cannot serve, corrupt NIXL metadata, a request from nobody, an abort of an unknown room) is
refused, counted and told why where it can hear, while the backend goes on. Frames are
SGLang's own (captured from its decode, sglang_frames.json) with the return address changed.
The real thing is tests/interop."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer.options import Hooks, NixlOptions, SglangOptions
from prefill_worker.transfer.sglang.backend import SglangBackend
from tests.clocks import FakeClock
from tests.patience import patient
from tests.polling import wait_until

CAPTURED = json.loads((Path(__file__).parents[2] / "unit/transfer/sglang_frames.json").read_text())
LAYOUT = KVLayout(2, 2, 16, "float32", 4, 32)  # what the captured decode was built for
HEALTH_STALE_S = 0.5  # make_backend's: /health fails when the engine has not turned this long


class FakeDecode:
    """A PUSH socket to the worker's control socket and a PULL for its replies."""

    def __init__(self, control: str) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(control)

    def send(self, kind: str, **changes: bytes) -> None:
        """A captured frame with this decode's return address and ``changes`` (by index)."""
        frames = [base64.b64decode(f) for f in CAPTURED["0.5.23"][kind]]
        frames[2], frames[3] = b"127.0.0.1", b"%d" % self.port  # ip, port: in all three kinds
        for index, value in changes.items():
            frames[int(index.lstrip("f"))] = value
        self.push.send_multipart(frames)

    def reply(self, backend: SglangBackend, timeout_s: float = 10.0) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            backend.poll()
            if self.pull.poll(5):
                return self.pull.recv_multipart()
        raise AssertionError("no reply from the worker")

    def close(self) -> None:
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


@pytest.fixture
def backend() -> Iterator[SglangBackend]:
    pool = np.zeros(2 * LAYOUT.num_layers * LAYOUT.region_bytes, np.uint8)
    backend = make_backend(pool, clock=FakeClock(100.0))
    yield backend
    backend.close()


def make_backend(pool: np.ndarray, **kwargs: Any) -> SglangBackend:
    aux = AuxPool(4)
    base = int(pool.ctypes.data)
    starts = [base + i * LAYOUT.region_bytes for i in range(4)]
    regions = KVRegions(LAYOUT, tuple(starts[:2]), tuple(starts[2:]), "cpu", aux.base_addr, 4)
    hooks = Hooks(**{k: kwargs.pop(k) for k in ("clock", "is_engine_live") if k in kwargs})
    nixl = NixlOptions("prefill-test", ucx_net_devices="lo")
    kwargs.setdefault("health_stale_s", HEALTH_STALE_S)
    options = SglangOptions("127.0.0.1:0", "127.0.0.1", 0, "auto", 2.0, 1.0, nixl=nixl, **kwargs)
    return SglangBackend(regions, options, hooks)


@pytest.fixture
def decode(backend: SglangBackend) -> Iterator[FakeDecode]:
    fake = FakeDecode(backend.endpoints["sglang_control"])
    yield fake
    fake.close()


def get(backend: SglangBackend, path: str, method: str = "GET") -> tuple[int, str]:
    url = f"http://{backend.bootstrap_endpoint}{path}"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, method=method), timeout=patient(5)
        ) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_bootstrap_routes_answer_as_sglangs(backend: SglangBackend) -> None:
    ranks = "prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"
    status, body = get(backend, "/route?" + ranks.format(-1, -1, -1, -1))
    assert status == 200
    assert json.loads(body) == {
        "attn_tp_size": 1,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 4,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": True,
    }
    status, body = get(backend, "/route?" + ranks.format(0, 0, 0, 0))
    rank = json.loads(body)
    assert status == 200
    assert f"tcp://{rank['rank_ip']}:{rank['rank_port']}" == backend.endpoints["sglang_control"]
    assert get(backend, "/route?" + ranks.format(1, 0, 0, 0))[0] == 404
    assert get(backend, "/route?prefill_dp_rank=0")[0] == 400
    assert get(backend, "/route?" + ranks.format("x", 0, 0, 0))[0] == 400
    assert get(backend, "/route", method="PUT")[0] == 405
    backend.poll()
    assert get(backend, "/health") == (200, "OK")


def test_health_fails_while_the_engine_does_not_turn(backend: SglangBackend) -> None:
    clock = backend.clock
    assert isinstance(clock, FakeClock)
    backend.poll()
    clock.now += HEALTH_STALE_S
    assert get(backend, "/health")[0] == 200  # turned within health_stale_s
    clock.now += 0.01
    assert get(backend, "/health")[0] == 503
    backend.poll()
    assert get(backend, "/health")[0] == 200


def test_health_fails_while_the_engine_is_stuck_in_a_forward() -> None:
    """The backend turns during forwards too, so a fresh poll is not enough: a forward
    stuck by the daemon's liveness rule fails ``/health`` (SGLang decodes then fail their
    rooms)."""
    pool = np.zeros(2 * LAYOUT.num_layers * LAYOUT.region_bytes, np.uint8)
    verdicts = [True]
    backend = make_backend(pool, clock=FakeClock(100.0), is_engine_live=lambda: verdicts[-1])
    try:
        backend.poll()
        assert get(backend, "/health")[0] == 200
        verdicts.append(False)
        backend.poll()
        assert get(backend, "/health")[0] == 503
        verdicts.append(True)
        assert get(backend, "/health")[0] == 200
    finally:
        backend.close()


def test_what_a_decode_should_not_send_is_refused_and_counted(
    backend: SglangBackend, decode: FakeDecode
) -> None:
    decode.push.send_multipart([b"HELLO", b"world"])
    decode.push.send_multipart([b"NixlMsgGuard", b"12"])
    wait_until(lambda: backend.poll() or backend.reject_counts.get("bad_message") == 2, 5)

    # Nobody registered: the request learns why.
    decode.send("request")
    tag, room, status, rank, reason = decode.reply(backend)
    assert (tag, room, status, rank) == (b"KV_STATUS", b"1234", b"0", b"0")
    assert b"not registered" in reason

    # A registration this worker cannot serve: the decode's next request carries the reason.
    decode.send("registration", f10=b"3")  # attention TP 3: 2 KV heads do not split
    decode.send("request")
    assert b"attention TP size 3" in decode.reply(backend)[4]
    assert backend.reject_counts["unsupported"] == 1 and backend.num_peers == 0

    # Corrupt NIXL metadata never reaches NIXL: refused by its header check.
    frames = [base64.b64decode(f) for f in CAPTURED["0.5.23"]["registration"]]
    metadata = frames[5][:30] + b"\xff" + frames[5][31:]
    decode.send("registration", f5=metadata)
    wait_until(lambda: backend.poll() or backend.reject_counts.get("bad_metadata") == 1, 5)
    assert backend.num_peers == 0

    # An abort of a room nobody claimed is acknowledged (with its generation) and changes nothing.
    decode.send("abort")
    assert decode.reply(backend) == [b"ABORT_ACK", b"1234", b"0", b"1"]
    backend.check_integrity()
    assert backend.num_open_senders == 0 and backend.num_inflight_transfers() == 0


def test_both_routes_answer_503_through_the_rejoin_window() -> None:
    """After a restart SGLang decodes must miss their heartbeats: /health and /route say 503
    for ``rejoin_s`` after start, then answer as usual."""
    pool = np.zeros(2 * LAYOUT.num_layers * LAYOUT.region_bytes, np.uint8)
    now = [100.0]
    backend = make_backend(pool, clock=lambda: now[0], rejoin_s=12.0)
    ranks = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    try:
        backend.poll()
        now[0] += 11.9
        assert get(backend, "/health")[0] == 503
        assert get(backend, ranks)[0] == 503
        now[0] += 0.1
        backend.poll()
        assert get(backend, "/health") == (200, "OK")
        assert get(backend, ranks)[0] == 200
    finally:
        backend.close()
