"""Issue 16: the real SGLang PD router (smg 1.13.0) drives this worker end to end.

smg registers the worker after its own start-up probes (health, /v1/models, /server_info,
/model_info, loads, the bootstrap port), pairs it with the reference decode peer, and every
request below goes client → smg → worker (HTTP API front) + decode peer, the KV over NIXL."""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import threading
import time

import pytest
import torch

from tests.checkpoints import hf_model, prompt
from tests.polling import wait_until
from tests.smg.conftest import Stack, http, sse_events

LENGTHS = (3, 16, 29, 47, 70)  # tiny-test: chunk_size 16, page_size 4
NUM_NEW_TOKENS = 20


@functools.cache
def greedy_model(checkpoint):  # type: ignore[no-untyped-def]
    model = hf_model(checkpoint)
    model.generation_config.eos_token_id = None  # the decode peer runs with --ignore-eos
    return model


def hf_generate(checkpoint, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = greedy_model(checkpoint).generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


def greedy(ids: list[int], **extra: object) -> dict[str, object]:
    params = {"temperature": 0, "max_new_tokens": NUM_NEW_TOKENS}
    return {"input_ids": ids, "sampling_params": params, **extra}


def test_through_smg_equals_transformers_generate(plain_stack: Stack, checkpoint) -> None:
    """Also on this stack: prompt logprobs and a stream (below); it stops cleanly after them
    (``plain_stack``)."""
    ok = 'prefill_worker_requests_total{reason="ok"'
    served_before = plain_stack.prefills[0].metric(ok)
    for n in LENGTHS:
        ids = prompt(n, seed=n)
        status, body = plain_stack.generate(greedy(ids))
        assert status == 200, body
        assert body["output_ids"] == hf_generate(checkpoint, ids), f"prompt of {n}"
        assert body["meta_info"]["prompt_tokens"] == n
    assert plain_stack.prefills[0].metric(ok) == served_before + len(LENGTHS)


def test_a_bad_request_reaches_the_client_without_retries(stack: Stack) -> None:
    prefills = [stack.start_prefill(), stack.start_prefill()]
    stack.start_decode()
    stack.start_router()
    status, body = stack.generate(greedy([1, 2, 320]))  # 320 is outside the vocabulary
    assert status == 400, body
    assert "outside" in body["error"]["message"]
    refused = 'prefill_worker_rejects_total{code="token_out_of_range"}'
    wait_until(lambda: sum(p.metric(refused) for p in prefills) >= 1, 5, "the refusal")
    assert sum(p.metric(refused) for p in prefills) == 1  # one attempt: no retry


def test_overloaded_prefill_429_is_retried_on_the_other(stack: Stack) -> None:
    """Worker A holds its one allowed request (a room no decode ever claims); every request
    the router sends A is refused with 429, its room withdrawn, and the retry lands on B."""
    busy = stack.start_prefill(
        "http_api.max_inflight_requests=1", "scheduler.bootstrap_timeout_s=120"
    )
    other = stack.start_prefill()
    stack.start_decode()
    stack.start_router()
    hold(f"{busy.url}/generate", greedy([5, 6, 7], bootstrap_room=1))
    wait_until(lambda: busy.metric("prefill_worker_queue_requests") == 1, 10, "A holds one")
    for n in (4, 6, 8, 10):
        status, body = stack.generate(greedy(prompt(n, seed=n)))
        assert status == 200, body
    assert busy.metric('prefill_worker_rejects_total{code="overloaded"}') >= 1
    assert other.metric('prefill_worker_requests_total{reason="ok"') == 4
    assert busy.metric('prefill_worker_requests_total{reason="ok"') == 0


def test_draining_prefill_stops_getting_requests(stack: Stack) -> None:
    """A draining worker answers /health 503; once smg's health check has seen it, every
    request goes to the other worker (the drained one still finishes what it holds)."""
    draining = stack.start_prefill(
        "scheduler.bootstrap_timeout_s=120", "daemon.drain_timeout_s=120"
    )
    other = stack.start_prefill()
    stack.start_decode()
    stack.start_router("--health-check-interval-secs", "1", "--health-failure-threshold", "1")
    # Something in flight keeps the draining worker alive (a drain ends when it is idle).
    hold(f"{draining.url}/generate", greedy([5, 6, 7], bootstrap_room=2))
    wait_until(lambda: draining.metric("prefill_worker_queue_requests") == 1, 10, "held")
    assert draining.worker.http("/drain", method="POST")[0] == 202
    wait_until(lambda: not _is_healthy(stack, draining.url), 15, "smg sees the drain")
    sent_before = draining.metric("prefill_worker_rejects_total")
    for n in (4, 6, 8, 10):
        status, body = stack.generate(greedy(prompt(n, seed=n)))
        assert status == 200, body
    assert draining.metric("prefill_worker_rejects_total") == sent_before  # none sent there
    assert other.metric('prefill_worker_requests_total{reason="ok"') == 4


def hold(url: str, body: dict[str, object]) -> None:
    """POST from a thread that nobody waits for (the worker is killed at the end of the test,
    its connection with it)."""

    def post() -> None:
        with contextlib.suppress(OSError):
            http(url, body, timeout_s=300)

    threading.Thread(target=post, daemon=True).start()


def _is_healthy(stack: Stack, url: str) -> bool:
    _, body = http(f"{stack.router}/workers", timeout_s=2)
    [worker] = [w for w in body["workers"] if w["url"] == url]
    return bool(worker["is_healthy"])


def test_a_refused_room_fails_at_the_decode_at_once(stack: Stack) -> None:
    """The router sends a request to prefill and decode at once; when the prefill refuses it
    (429 here), the decode that wants its room must hear that it failed now, not at its own
    timeout (the worker's bootstrap timeout is 120 s here), so that the router's retry is not
    held up behind it. Sent as the router does: both at once, so either may come first."""
    busy = stack.start_prefill(
        "http_api.max_inflight_requests=1", "scheduler.bootstrap_timeout_s=120"
    )
    stack.start_decode()
    hold(f"{busy.url}/generate", greedy([5, 6, 7], bootstrap_room=1))
    wait_until(lambda: busy.metric("prefill_worker_queue_requests") == 1, 10, "A holds one")
    where = {"bootstrap_host": "127.0.0.1", "bootstrap_port": busy.bootstrap_port}
    for room in (11, 12, 13):
        body = greedy(prompt(6, seed=room), bootstrap_room=room, **where)
        answers: list[tuple[int, object]] = []
        asker = threading.Thread(target=_post_into, args=(stack.decode_url, body, answers))
        asker.start()
        assert http(f"{busy.url}/generate", body)[0] == 429
        asker.join(40)
        [(status, answer)] = answers  # the decode answered within 30 s, not after 120
        assert status == 500, answer


def _post_into(url: str, body: dict[str, object], answers: list[tuple[int, object]]) -> None:
    answers.append(http(url, body, timeout_s=30))


def test_prompt_logprobs_arrive_through_smg(plain_stack: Stack, checkpoint) -> None:
    """smg prepends the prefill's ``input_token_logprobs`` to the decode's (empty): the client
    gets SGLang's prompt logprobs from ``logprob_start_len``, equal to transformers'."""
    stack = plain_stack
    ids = prompt(29, seed=290)  # tiny-test: chunk 16, the scored range crosses it
    with torch.no_grad():
        logits = greedy_model(checkpoint)(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    for start in (0, 11, 29):
        body = greedy(ids, return_logprob=True, logprob_start_len=start)
        status, answer = stack.generate(body)
        assert status == 200, answer
        assert answer["output_ids"] == hf_generate(checkpoint, ids)
        entries = answer["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[start:]
        assert all(e[0] is None for e in entries[:1])  # SGLang: the start token has none
        ref = [float(logprobs[p, ids[p + 1]]) for p in range(start, len(ids) - 1)]
        assert [e[0] for e in entries[1:]] == pytest.approx(ref, abs=1e-4), start


def test_a_stream_through_smg_carries_the_same_tokens(plain_stack: Stack, checkpoint) -> None:
    """``stream: true``: smg streams the decode's events (the SGLang-mode peer answers in SSE,
    as an SGLang decode does); the last event holds the whole greedy answer."""
    ids = prompt(29, seed=291)
    status, raw = plain_stack.generate(greedy(ids, stream=True))
    assert status == 200, raw
    events = sse_events(raw if isinstance(raw, str) else json.dumps(raw))
    assert events[-1] == "[DONE]", raw
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert len(chunks) == NUM_NEW_TOKENS, raw
    assert chunks[-1]["output_ids"] == hf_generate(checkpoint, ids)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_the_decode_peer_exits_0_on_sigterm_with_a_request_open(stack: Stack) -> None:
    """SIGTERM while a request waits for its KV: the request gets a 503, the peer exits 0
    (it once raised TimeoutError from its HTTP face's shutdown, waiting on that request)."""
    prefill = stack.start_prefill("scheduler.bootstrap_timeout_s=60")  # the room waits
    stack.start_decode()
    peer = stack.children[0]
    where = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port}
    body = greedy(prompt(8, seed=80), bootstrap_room=4242, **where)
    answers: list[tuple[int, object]] = []
    url = f"http://127.0.0.1:{stack.decode_port}/generate"
    thread = threading.Thread(target=_post_into, args=(url, body, answers))
    thread.start()
    wait_until(lambda: "1 in flight" in peer.log_tail(), 30, "the peer to take the request")
    assert peer.stop(30) == 0, peer.log_tail()
    thread.join(30)
    assert answers and answers[0][0] == 503, answers


def test_a_restarted_prefill_serves_through_smg_again(stack: Stack) -> None:
    """The worker is SIGKILLed and back on its ports within seconds: the decode peer (SGLang's
    decode code, its heartbeat every 2 s here; or the native SDK) serves again on its own,
    within the rejoin window (5 s here) and a request, and every request after that succeeds.
    SIGTERM and the downtimes: tests/interop/test_restart.py and bench/restart.py."""
    prefill = stack.start_prefill()
    stack.start_decode()
    stack.start_router()
    assert stack.generate(greedy(prompt(12, seed=1)))[0] == 200
    ready_at = stack.restart_prefill(prefill, signal.SIGKILL, "transfer.sglang_rejoin_s=5")
    wait_until(lambda: stack.generate(greedy(prompt(12, seed=2)))[0] == 200, 15, "a success")
    assert time.monotonic() - ready_at < 15
    assert all(stack.generate(greedy(prompt(12, seed=s)))[0] == 200 for s in range(3, 8))
    codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes
