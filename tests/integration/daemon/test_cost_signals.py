"""The cost signals and the SLO admission of a real worker process, through its real HTTP front
(``/v1/loads``, ``/metrics``, 429) and its real ZMQ ingress (``pong``, ``overloaded``)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefill_worker.ingress.client import RequestRejected
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import Decode, free_port, wait_until
from tests.integration.daemon.test_http_api import Api, api_settings, generate
from tests.patience import patient


def _rank(api: Api) -> dict:
    status, body = api.get("/v1/loads")
    assert status == 200, body
    return body["loads"][0]


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def test_signals_are_published_and_the_slo_refuses(worker_factory, router_factory) -> None:
    """A cold worker admits under any SLO (nothing to predict from) and reports its queued
    tokens; once a forward is measured, a request whose predicted TTFT exceeds the SLO (here
    1 µs, so any) is refused on both fronts while work is queued, and counted as
    ``ttft_slo`` (an idle worker admits it: tests/reliability/test_slo_admission.py)."""
    port = free_port()
    # Request 7001 waits for its decode while the test reads the queue: 60 s (tiny-test's 5 s)
    # so that no slow step of the test lets its bootstrap timeout end it first, and not
    # prefilled before its want (optimistic prefill off) so that its tokens stay queued.
    settings = (
        "admission.ttft_slo_s=0.000001",
        "scheduler.bootstrap_timeout_s=60",
        "scheduler.optimistic_prefill=false",
    )
    worker = worker_factory(*api_settings(port, *settings))
    api, decode = Api(port), Decode(worker.bootstrap)
    router = router_factory(worker.ingress)
    ids = prompt(37, seed=3)
    try:
        cold = _rank(api)
        assert (cold["queued_tokens"], cold["running_tokens"]) == (0, 0)
        assert cold["prefill_rate_tokens_per_s"] is None and cold["backlog_s"] == 0.0
        assert cold["num_waiting_reqs"] == 0 and cold["max_total_num_tokens"] == 256 * 4
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(api.post, "/generate", generate(ids, 7001))
            wait_until(lambda: _rank(api)["queued_tokens"] == len(ids), 10, "queued tokens")
            assert _rank(api)["backlog_s"] is None  # work, and no rate yet
            pong = router.ping()
            assert (pong.queued_tokens, pong.backlog_s, pong.prefill_rate_tps) == (37, None, None)
            decode.want(7001, len(ids))
            assert decode.wait([7001])[7001].state.value == "done"  # turns the decode peer
            status, body = held.result(timeout=patient(60))
        assert status == 200, body
        warm = _rank(api)
        assert warm["prefill_rate_tokens_per_s"] > 0
        assert (warm["queued_tokens"], warm["running_tokens"], warm["backlog_s"]) == (0, 0, 0.0)
        assert warm["handshake_s"] > 0 and warm["transfer_s"] >= 0
        pong = router.ping()
        assert pong.prefill_rate_tps == pytest.approx(warm["prefill_rate_tokens_per_s"])
        assert pong.transfer_s == pytest.approx(warm["transfer_s"])

        with ThreadPoolExecutor(1) as pool:  # 7004 queued (no want yet): the worker is busy
            held = pool.submit(api.post, "/generate", generate(ids, 7004))
            wait_until(lambda: _rank(api)["queued_tokens"] == len(ids), 10, "queued tokens")
            decode.want(7002, len(ids))
            status, body = api.post("/generate", generate(ids, 7002))
            assert status == 429 and body["error"]["code"] == "overloaded"
            assert "predicted TTFT" in body["error"]["message"]
            withdrawn = decode.wait([7002])[7002]  # by its reason, not within 3 s (was)
            assert (withdrawn.state.value, withdrawn.reason) == ("failed", "aborted by the router")
            with pytest.raises(RequestRejected) as refused:
                router.prefill(ids, 7003)
            assert refused.value.code == "overloaded"
            assert "predicted TTFT" in refused.value.reject.message
            decode.want(7004, len(ids))
            assert decode.wait([7004])[7004].state.value == "done"
            status, body = held.result(timeout=patient(60))
            assert status == 200, body

        status, text = api.get("/metrics")
        assert status == 200
        assert _metric(text, 'prefill_worker_rejects_total{code="ttft_slo"}') == 2
        assert _metric(text, "prefill_worker_prefill_rate_tokens_per_second") > 0
        # the gauge follows the engine's published snapshot, which can trail a scrape by a turn
        wait_until(
            lambda: _metric(api.get("/metrics")[1], "prefill_worker_backlog_seconds") == 0.0,
            10,
            "backlog gauge back to 0",
        )
        # idle now, so nothing moves the snapshot: the prediction and the rate it came from are
        # read from one scrape (the rate the first request left is stale by the later forwards)
        idle = api.get("/metrics")[1]
        predicted = _metric(idle, 'prefill_worker_predicted_ttft_seconds{prompt_tokens="1024"}')
        assert predicted > 1024 / _metric(idle, "prefill_worker_prefill_rate_tokens_per_second")
    finally:
        decode.close()
