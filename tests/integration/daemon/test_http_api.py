"""The HTTP API front (issue 16) of a real worker process, over real HTTP on 127.0.0.1: the
KV lands at a real decode peer (``KVReceiver`` over NIXL) before the answer comes, both
ingresses feed one engine, and every refusal carries the status a PD router acts on.

One worker serves the tests that leave it serving (``api_worker``); the draining, overload and
disconnect tests start their own."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from prefill_worker.ingress.messages import unpack_logprobs
from tests.checkpoints import hf_model, prompt
from tests.integration.daemon.conftest import Decode, Worker, free_port, wait_until
from tests.integration.daemon.test_daemon import hf_reference
from tests.patience import patient

MODEL_NAME = "tiny-llama"


def api_settings(port: int, *extra: str) -> tuple[str, ...]:
    return (
        "http_api.enabled=true",
        f"http_api.bind=127.0.0.1:{port}",
        f"http_api.served_model_name={MODEL_NAME}",
        *extra,
    )


class Api:
    """A plain HTTP client of the worker's HTTP API."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> tuple[int, Any]:
        return self._send(urllib.request.Request(self.base + path))

    def post(self, path: str, body: object, timeout_s: float = 60.0) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, headers={"Content-Type": "application/json"}
        )
        return self._send(request, timeout_s)

    def _send(self, request: urllib.request.Request, timeout_s: float = 10.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode()


@pytest.fixture(scope="module")
def api_worker(
    tmp_path_factory: pytest.TempPathFactory, checkpoint
) -> Iterator[tuple[Worker, Api]]:  # type: ignore[no-untyped-def]
    from tests.integration.daemon.conftest import start_worker

    port = free_port()
    worker = start_worker(tmp_path_factory.mktemp("api-worker"), checkpoint, *api_settings(port))
    try:
        worker.child.wait_ready(120)
        yield worker, Api(port)
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()


@pytest.fixture
def decode(api_worker) -> Iterator[Decode]:  # type: ignore[no-untyped-def]
    peer = Decode(api_worker[0].bootstrap)
    yield peer
    peer.close()


def generate(ids: list[int] | list[list[int]], room: int | list[int], **extra: Any) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 1,
        "bootstrap_room": room,
        "model": MODEL_NAME,
        "log_metrics": True,
        **extra,
    }


def test_generate_answers_once_kv_and_first_token_landed(api_worker, decode, checkpoint) -> None:
    _, api = api_worker
    ids, room = prompt(23, seed=5), 3001
    decode.want(room, len(ids))
    body = generate(ids, room, return_logprob=True, rid="r1")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(api.post, "/generate", body)
        wait_until(lambda: _progressed(decode) and answer.done(), 30, "the answer")
        status, body = answer.result()
    assert status == 200, body
    # The worker answers once every write landed; the decode hears of it on its own socket,
    # maybe after its last turn above: it waits for that status (a room failing fails here).
    assert decode.receiver.wait(room, patient(30)).state.value == "done"
    first_token, hf_kv = hf_reference(checkpoint, ids)
    assert body["output_ids"] == [first_token]
    meta = body["meta_info"]
    assert meta["id"] == "r1"
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 1)
    assert meta["input_token_logprobs"] == []  # SGLang's default logprob_start_len
    [[logprob, token, _]] = meta["output_token_logprobs"]
    assert token == first_token and logprob <= 0
    assert decode.receiver.read_aux(decode.rooms[room][1]).first_token_id == first_token
    for layer, (k_ref, v_ref) in enumerate(hf_kv):
        k, v = decode.kv(room, len(ids), layer)
        torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=0)


def test_cached_tokens_is_the_prefix_cache_hit_as_sglang_reports_it(api_worker, decode) -> None:
    """SGLang's prefill reports in ``meta_info.cached_tokens`` the prompt tokens its prefix cache
    supplied (its decode reports the same, read off the metadata row); not the prefix the
    decode held, which an SGLang decode never has."""
    _, api = api_worker
    first = prompt(23, seed=231)  # 5 full pages (page size 4) enter the cache
    sharing = first[:20] + prompt(9, seed=232)
    answers = []
    for room, ids in ((3101, first), (3102, sharing)):
        decode.want(room, len(ids))
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(api.post, "/generate", generate(ids, room))
            wait_until(lambda answer=answer: _progressed(decode) and answer.done(), 30, "answer")
            status, body = answer.result()
        assert status == 200, body
        answers.append(body["meta_info"]["cached_tokens"])
    assert answers == [0, 20]


def test_batch_and_completions_and_zmq_at_once(api_worker, decode, router_factory) -> None:
    """A /generate batch (list bootstrap fields), /v1/completions and a ZMQ prefill, all in
    flight together in one engine: each gets the same first token as the others would."""
    worker, api = api_worker
    ids = [prompt(9, seed=1), prompt(30, seed=2)]
    rooms = {"batch": [4001, 4002], "completion": 4003, "zmq": 4004}
    for room, n in ((4001, 9), (4002, 30), (4003, 30), (4004, 30)):
        decode.want(room, n)
    router = router_factory(worker.ingress)
    with ThreadPoolExecutor(3) as pool:
        batch = pool.submit(api.post, "/generate", generate(ids, rooms["batch"]))
        completion_body = {
            "model": MODEL_NAME,
            "prompt": ids[1],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 1,
            "bootstrap_room": rooms["completion"],
        }
        completion = pool.submit(api.post, "/v1/completions", completion_body)
        zmq = pool.submit(router.prefill, ids[1], rooms["zmq"], return_logprob=True)
        states = decode.wait([4001, 4002, 4003, 4004])
        (batch_status, batch_body), (c_status, c_body) = batch.result(60), completion.result(60)
        result = zmq.result(60)
    assert batch_status == 200 and isinstance(batch_body, list) and len(batch_body) == 2
    assert c_status == 200, c_body
    assert batch_body[1]["output_ids"] == [result.first_token_id]
    assert c_body["object"] == "text_completion" and c_body["model"] == MODEL_NAME
    assert c_body["choices"][0]["logprobs"]["token_logprobs"] == [
        pytest.approx(result.first_token_logprob, abs=1e-5)
    ]
    assert c_body["usage"]["prompt_tokens"] == 30
    assert all(s.state.value == "done" for s in states.values())


def test_prompt_logprobs_equal_transformers(api_worker, decode, router_factory, checkpoint) -> None:
    """SGLang's ``input_token_logprobs`` from ``logprob_start_len`` for a batch (chunk 16: the
    scored ranges cross chunk boundaries), then the same prompt over ZMQ, where the prefix
    cache the batch filled is capped at the start; both against transformers."""
    worker, api = api_worker
    ids = [prompt(40, seed=51), prompt(40, seed=52), prompt(9, seed=53)]
    starts, rooms = [0, 21, 9], [5001, 5002, 5003]
    for room, prompt_ids in zip(rooms, ids, strict=True):
        decode.want(room, len(prompt_ids))
    body = generate(ids, rooms, return_logprob=True, logprob_start_len=starts)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(api.post, "/generate", body)
        decode.wait(rooms)
        status, answers = answer.result(60)
    assert status == 200, answers
    for prompt_ids, start, got in zip(ids, starts, answers, strict=True):
        entries = got["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt_ids[start:]  # [] from the prompt's end
        assert all(e[0] is None for e in entries[:1]) and all(e[2] is None for e in entries)
        values = [e[0] for e in entries[1:]]
        assert values == pytest.approx(hf_prompt_logprobs(checkpoint, prompt_ids, start), abs=1e-4)
    decode.want(5004, 40)
    router = router_factory(worker.ingress)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(router.prefill, ids[1], 5004, return_logprob=True, logprob_start_len=21)
        decode.wait([5004])
        result = sent.result(60)
    assert isinstance(result.prompt_logprobs, bytes) and result.num_prefix_hit_tokens == 20
    values = list(unpack_logprobs(result.prompt_logprobs))
    assert values == pytest.approx(hf_prompt_logprobs(checkpoint, ids[1], 21), abs=1e-4)


def hf_prompt_logprobs(checkpoint: Path, ids: list[int], start: int) -> list[float]:
    """transformers' logprob of each prompt token after ``start`` (fp32)."""
    with torch.no_grad():
        logits = hf_model(checkpoint)(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[p, ids[p + 1]]) for p in range(start, len(ids) - 1)]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "malformed"),
        (generate([1, 2, 3], 7) | {"bootstrap_room": None}, "missing_field"),
        (generate([1, 2, 320], 7), "token_out_of_range"),
        (generate([], 7), "empty_prompt"),
        (generate(list(range(300)) * 2, 7), "prompt_too_long"),
        (generate([1, 2], [7, 8]), "bad_field"),  # one prompt, two rooms
        (generate([1, True], 7), "bad_field"),
        ({"text": "hello", "bootstrap_room": 7}, "bad_field"),  # no tokenizer in this model
        (generate([1, 2], 7, sampling_params={"temperature": -1}), "bad_sampling"),
        (generate([1, 2], 7, sampling_params={"regex": "a+"}), "bad_sampling"),
        (generate([1, 2], 7, return_logprob=True, logprob_start_len=3), "bad_field"),
        (generate([1, 2], 7, return_logprob=True, logprob_start_len=-2), "bad_field"),
    ],
)
def test_bad_requests_get_400_naming_why(api_worker, body: Any, code: str) -> None:
    _, api = api_worker
    status, answer = api.post("/generate", body)
    assert status == 400, answer
    assert answer["error"]["code"] == code and answer["error"]["message"]


def test_probes_answer_what_smg_reads(api_worker) -> None:
    _, api = api_worker
    assert api.get("/health")[0] == 200
    status, models = api.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL_NAME]
    for path in ("/server_info", "/get_server_info"):
        status, info = api.get(path)
        assert status == 200 and info["disaggregation_mode"] == "prefill"
        assert (info["tp_size"], info["dp_size"], info["page_size"]) == (1, 1, 4)
        assert info["served_model_name"] == MODEL_NAME
    for path in ("/model_info", "/get_model_info"):
        status, info = api.get(path)
        assert status == 200 and info["is_generation"] is True
        assert info["architectures"] == ["LlamaForCausalLM"]
    for path in ("/loads?model=x", "/v1/loads?include=core,disagg,queues,memory"):
        status, loads = api.get(path)
        assert status == 200 and loads["loads"][0]["max_total_num_tokens"] == 256 * 4
    assert models["data"][0]["owned_by"] == "sglang"  # smg: SGLang's PD wire
    assert api.get("/version")[0] == 404  # smg takes a server with /version for vLLM
    status, text = api.get("/metrics")
    assert status == 200 and "prefill_worker_requests_total" in text


def test_overloaded_is_429_and_nothing_hangs(worker_factory) -> None:
    """One prompt held at bootstrap (no decode ever wants it) fills a front of one: the next
    gets 429 at once; the held one ends by the bootstrap deadline with a 500 (retryable)."""
    port = free_port()
    worker = worker_factory(*api_settings(port, "http_api.max_inflight_requests=1"))
    api, decode = Api(port), Decode(worker.bootstrap)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(api.post, "/generate", generate([1, 2, 3], 9001))
            wait_until(lambda: _num_live(api) == 1, 10, "the held request")
            decode.want(9002, 2)  # the router sent the refused request to a decode too
            status, body = api.post("/generate", generate([4, 5], 9002))
            assert status == 429 and body["error"]["code"] == "overloaded"
            # Its room is withdrawn: the decode learns it now, not at its own timeout.
            assert decode.wait([9002], timeout_s=3)[9002].state.value == "failed"
            status, body = held.result(timeout=patient(30))  # tiny-test: bootstrap_timeout_s 5
        assert status == 500 and body["error"]["code"] == "bootstrap_timeout"
    finally:
        decode.close()


def test_draining_answers_503_on_health_and_requests(worker_factory) -> None:
    """Then the idle worker keeps answering 503 until ``daemon.drain_min_s`` (a router that
    health-checks it, smg, learns of the drain from /health, not from a closed port); and a
    SIGTERM that comes while it is on its way out (a rolling update's, after its preStop
    drain) leaves the exit code 0: Python restores a handled signal's default action while
    the interpreter shuts down, an ignored one stays ignored."""
    port = free_port()
    admin = "metrics.allow_unauthenticated_admin=true"
    drain = ("daemon.drain_timeout_s=30", "daemon.drain_min_s=2")
    worker = worker_factory(*api_settings(port, admin, *drain))
    api = Api(port)
    decode = Decode(worker.bootstrap)
    try:
        ids = prompt(12, seed=9)
        with ThreadPoolExecutor(1) as pool:
            inflight = pool.submit(api.post, "/generate", generate(ids, 9101))
            wait_until(lambda: api.get("/loads")[1]["loads"][0]["num_total_reqs"] == 1, 10, "in")
            drained_at = time.monotonic()  # before: the drain cannot start earlier
            assert worker.http("/drain", method="POST")[0] == 202
            wait_until(lambda: api.get("/health")[0] == 503, 10, "/health 503")
            status, body = api.post("/generate", generate(ids, 9102))
            assert status == 503 and body["error"]["code"] == "draining"
            decode.want(9101, len(ids))  # the request in flight still finishes
            decode.wait([9101])
            assert inflight.result(timeout=patient(30))[0] == 200
        wait_until(lambda: "exit 0" in worker.child.log_tail(), 30, "the drain to end")
        assert time.monotonic() - drained_at >= 2.0
        assert _sigterm_until_exit(worker.proc, 30) == 0
    finally:
        decode.close()


def _sigterm_until_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM every 50 ms until the process is gone: its teardown takes seconds (NIXL, UCX,
    the interpreter's own), and every part of it must keep the exit code."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.05)
    return proc.wait(1)


def test_client_gone_aborts_its_request(worker_factory) -> None:
    port = free_port()
    worker = worker_factory(*api_settings(port))
    body = json.dumps(generate([1, 2, 3], 9201)).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(head + body)
        wait_until(lambda: _num_live(Api(port)) == 1, 10, "the request in the engine")
    wait_until(lambda: _num_aborted(worker) == 1, 10, "the abort")
    # /loads is the engine's load snapshot, published at the end of a turn: it may lag the
    # outcome counter by one turn.
    wait_until(lambda: _num_live(Api(port)) == 0, 10, "the load snapshot without it")


def _progressed(decode: Decode) -> bool:
    """Drive the decode peer one turn (heartbeats, status messages); always True."""
    decode.receiver.progress()
    return True


def _num_live(api: Api) -> int:
    return int(api.get("/loads")[1]["loads"][0]["num_total_reqs"])


def _num_aborted(worker: Worker) -> float:
    text = worker.http("/metrics")[1]
    found = re.search(r'requests_total\{reason="aborted_by_router",status="aborted"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0
