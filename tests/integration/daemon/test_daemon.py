"""`prefill-worker serve` as a subprocess: requests end to end (router → worker → NIXL → decode,
checked against transformers), SIGTERM drain during a burst, forced stop, start-up failures,
sd_notify order, and the metrics endpoint.

The tests that leave the worker serving share one (``shared_worker``, port 0 everywhere; its
teardown checks the SIGTERM exit); the others start their own."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from prefill_worker.ingress.client import RequestRejected
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import describe_worker
from tests.checkpoints import hf_model, prompt
from tests.integration.daemon.conftest import Decode, Worker, wait_until
from tests.patience import patient

LENGTHS = (5, 17, 40, 63)
OK_REQUESTS = re.compile(r'^prefill_worker_requests_total\{reason="ok",status="ok"\} (\S+)$', re.M)


def num_ok_requests(worker: Worker) -> float:
    """``prefill_worker_requests_total`` for OK outcomes, from the worker's /metrics."""
    status, text = worker.http("/metrics")
    assert status == 200
    found = OK_REQUESTS.search(text)
    return float(found.group(1)) if found else 0.0


def hf_reference(checkpoint, ids: list[int]):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = hf_model(checkpoint)(torch.tensor([ids]), use_cache=True)
    kv = [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        for layer in out.past_key_values.layers
    ]
    return int(out.logits[0, -1].argmax()), kv


def test_requests_end_to_end(shared_worker, router_factory, checkpoint) -> None:
    worker = shared_worker
    assert worker.http("/readyz")[0] == 200
    assert worker.http("/livez")[0] == 200
    num_ok_before = num_ok_requests(worker)
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    prompts = {room: prompt(n, seed=room) for room, n in enumerate(LENGTHS, start=101)}
    for room, ids in prompts.items():
        decode.want(room, len(ids))
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = {
            room: pool.submit(router.prefill, ids, room, return_logprob=True)
            for room, ids in prompts.items()
        }
        statuses = decode.wait(list(prompts))
        results = {room: future.result(timeout=patient(60)) for room, future in futures.items()}
    for room, ids in prompts.items():
        first_token, hf_kv = hf_reference(checkpoint, ids)
        result = results[room]
        assert result.status is OutcomeStatus.OK, result
        assert result.first_token_id == first_token
        assert result.num_prompt_tokens == len(ids)
        assert result.first_token_logprob is not None and result.first_token_logprob <= 0
        assert statuses[room].state.value == "done"
        aux = decode.receiver.read_aux(decode.rooms[room][1])
        assert (aux.first_token_id, aux.num_prompt_tokens) == (first_token, len(ids))
        for layer, (k_ref, v_ref) in enumerate(hf_kv):
            k, v = decode.kv(room, len(ids), layer)
            torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=0)
    assert num_ok_requests(worker) == num_ok_before + len(prompts)
    decode.close()


def test_sigterm_during_burst_drains(worker_factory, router_factory) -> None:
    worker = worker_factory(env={"WATCHDOG_USEC": "400000"})
    decode = Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    prompts = {room: prompt(8 + 5 * room, seed=room) for room in range(1, 7)}
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = {room: pool.submit(router.prefill, ids, room) for room, ids in prompts.items()}
        # Every request accepted and waiting for its decode peer: now the signal.
        wait_until(lambda: router.ping().waiting == len(prompts), 30, "all requests accepted")
        wait_until(lambda: "WATCHDOG=1" in worker.notifications, 30, "a watchdog ping")
        worker.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: worker.http("/readyz")[0] == 503, 10, "readyz 503")
        status, body = worker.http("/readyz")
        assert (status, json.loads(body)["status"]) == (503, "draining")
        with pytest.raises(RequestRejected) as rejected:
            router.prefill(prompt(9, seed=99), 99)
        assert rejected.value.code == "draining"
        for room, ids in prompts.items():
            decode.want(room, len(ids))
        statuses = decode.wait(list(prompts))
        results = {room: future.result(timeout=patient(60)) for room, future in futures.items()}
    assert all(r.status is OutcomeStatus.OK for r in results.values()), results
    assert all(s.state.value == "done" for s in statuses.values())
    assert worker.wait_exit(30) == 0
    notes = list(worker.notifications)
    kinds = [n.split("\n")[0] for n in notes]
    before_ready = kinds[: kinds.index("READY=1")]
    assert before_ready[-1] == "STATUS=warming up"  # the warm-up forward, after the load
    loading = before_ready[:-1]  # model-load progress, with bytes and percent
    assert loading and all(k.startswith("STATUS=loading model: ") for k in loading), loading
    assert "GiB (100%" in loading[-1]
    assert "STOPPING=1" in kinds
    assert "WATCHDOG=1" in kinds[: kinds.index("STOPPING=1")], kinds
    assert kinds.index("READY=1") < kinds.index("STOPPING=1")
    decode.close()


def test_drain_timeout_fails_what_is_left(worker_factory, router_factory) -> None:
    worker = worker_factory("daemon.drain_timeout_s=1.0", "scheduler.bootstrap_timeout_s=60")
    router = router_factory(worker.ingress)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(router.prefill, prompt(10, seed=5), 5)  # no decode peer ever wants it
        wait_until(lambda: router.ping().waiting == 1, 30, "request accepted")
        sent_at = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        result = future.result(timeout=patient(30))
    assert result.status is OutcomeStatus.FAILED and "draining" in (result.error or "")
    assert worker.wait_exit(30) == 0
    assert time.monotonic() - sent_at < 15


def test_second_signal_forces(worker_factory, router_factory) -> None:
    worker = worker_factory("daemon.drain_timeout_s=60", "scheduler.bootstrap_timeout_s=60")
    router = router_factory(worker.ingress)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(router.prefill, prompt(10, seed=6), 6)
        wait_until(lambda: router.ping().waiting == 1, 30, "request accepted")
        worker.proc.send_signal(signal.SIGINT)
        wait_until(lambda: worker.http("/readyz")[0] == 503, 10, "draining")
        worker.proc.send_signal(signal.SIGINT)
        result = future.result(timeout=patient(30))
    assert result.status is OutcomeStatus.FAILED
    assert worker.wait_exit(20) == 1


def test_bad_checkpoint_exits_78_naming_the_step(worker_factory, tmp_path) -> None:
    worker = worker_factory(f"model.path={tmp_path / 'missing'}", ready=False)
    assert worker.wait_exit(60) == 78
    assert "start-up failed at step 'model load'" in worker.log()


def test_port_in_use_names_the_step(worker_factory) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = worker_factory(f"metrics.bind=127.0.0.1:{port}", ready=False)
        assert worker.wait_exit(60) == 1
    assert "start-up failed at step 'http'" in worker.log()


def test_port_zero_config_publishes_its_endpoints(shared_worker, router_factory) -> None:
    """configs/tiny-test.yaml binds port 0 everywhere: the ready file, `/readyz` and the
    sd_notify STATUS line all say what was bound, and a router can use it from there (the
    fixture checks that the ready file goes at exit)."""
    child, ready_file = shared_worker.child, shared_worker.ready_file
    endpoints = json.loads(ready_file.read_text())
    assert endpoints["pid"] == child.popen.pid
    host, _, port = endpoints["http"].rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    for name in ("ingress", "bootstrap"):
        assert endpoints[name].startswith("tcp://127.0.0.1:")
        assert not endpoints[name].endswith(":0")
    ready = next(n for n in child.notifications if n.startswith("READY=1"))
    assert all(str(endpoints[k]) in ready for k in ("ingress", "bootstrap", "http")), ready
    with urllib.request.urlopen(
        f"http://{endpoints['http']}/readyz", timeout=patient(5)
    ) as response:
        assert json.loads(response.read()) == {"status": "ready", **endpoints}
    # The pool layout, for a decode to size its pool by: in /readyz and from `describe`.
    layout = describe_worker(endpoints["bootstrap"], 10.0)
    assert endpoints["kv_layout"] == layout.summary()
    assert layout.kind in ("layer_major", "page_major") and layout.page_size >= 1
    decode = Decode(endpoints["bootstrap"])
    decode.want(7, 9)
    router = router_factory(endpoints["ingress"])
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(router.prefill, prompt(9, seed=7), 7)
        assert decode.wait([7])[7].state.value == "done"
        assert future.result(timeout=patient(60)).status is OutcomeStatus.OK
    decode.close()


def test_the_worker_warms_up_before_it_is_ready(shared_worker) -> None:
    """The warm-up forward runs before readiness: its STATUS comes before READY=1, the log
    and /metrics say how long it took."""
    notes = shared_worker.child.notifications
    warming = next(i for i, n in enumerate(notes) if n.startswith("STATUS=warming up"))
    assert warming < next(i for i, n in enumerate(notes) if n.startswith("READY=1"))
    assert re.search(r"warm-up: \d+ tokens in [\d.]+ s", shared_worker.log())
    status, text = shared_worker.http("/metrics")
    found = re.search(r"^prefill_worker_warmup_seconds (\S+)$", text, re.M)
    assert status == 200 and found and float(found.group(1)) > 0
