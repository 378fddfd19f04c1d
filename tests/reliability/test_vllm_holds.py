"""vLLM holds against other agents (issue #40): any agent that loaded the worker's metadata
(the side channel hands it to whoever asks) can send NIXL notifications.

- Finding 2: hold ids were sequential (``pw-<prefix>-N``) and a notification ``<id>:1`` from
  any agent released that hold, so the next request reused its blocks while the victim's
  decode still meant to read them; forged ``HB:`` kept staging held past the lease. Now ids
  carry 128 random bits and a hold's notifications count only from its reader.
- Finding 8: a pull naming a ``bootstrap_room`` took a pending native request's room (both
  failed), and two pulls on one room both got 200. A pull names no room now (the worker draws
  one, which only that request owns): one that does is refused 400.
- Finding 9: each malformed notification was one WARNING line (before: 1,000 lines). Each is
  counted; the log says the first and then at most one line per ``BAD_NOTIFICATION_LOG_S``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from prefill_worker.ingress.messages import Result
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import RoomState
from prefill_worker.transfer.vllm.desk import BAD_NOTIFICATION_LOG_S
from tests.checkpoints import prompt
from tests.integration.daemon.test_vllm_pull import (
    MODEL,
    PROXY_ASK,
    _metric,
    _prefill,
    _staging_used,
    pulled,
    receiver,
)
from tests.integration.vllm.decode import PullDecode
from tests.patience import patient
from tests.polling import wait_until
from tests.reliability.harness import Ledger, LiveDecode, Router

# the module's worker, its vLLM-shaped decode and the OTLP receiver it traces to
__all__ = ["pulled", "receiver"]
MALFORMED = ("prefill_worker_vllm_notifications_ignored_total", '{why="malformed"}')


def test_a_flood_of_malformed_notifications_is_counted_not_logged(pulled) -> None:
    worker, api, decode = pulled
    before = _metric(worker, *MALFORMED)
    lines_before = worker.log().count("notification ignored")
    for i in range(1000):
        decode.notify(f"not a notification {i}")
    wait_until(lambda: _metric(worker, *MALFORMED) == before + 1000, 60, "all 1000 counted")
    lines = worker.log().count("notification ignored") - lines_before
    assert 1 <= lines <= 2, f"{lines} log lines for 1000 notifications"  # 2: an interval passed
    assert BAD_NOTIFICATION_LOG_S >= 10
    params = _prefill(api, prompt(20, seed=7))["kv_transfer_params"]  # still serving
    decode.read(params["remote_block_ids"][0], f"{params['remote_request_id']}:1")
    wait_until(lambda: _staging_used(worker) == 0, 10.0, "the read's release")


FOREIGN = ("prefill_worker_vllm_notifications_ignored_total", '{why="foreign"}')


def test_another_agent_can_neither_release_nor_keep_a_decodes_hold(pulled) -> None:
    worker, api, decode = pulled
    thief = PullDecode(decode.meta, name="thief")  # handshook like any decode
    try:
        before = _metric(worker, *FOREIGN)
        first = _prefill(api, prompt(40, seed=11))["kv_transfer_params"]
        victim = _prefill(api, prompt(40, seed=12))["kv_transfer_params"]
        ids = [first["remote_request_id"], victim["remote_request_id"]]
        assert all(len(i) >= 32 + 3 for i in ids) and ids[0][:-1] != ids[1][:-1], ids
        decode.notify(f"HB:{victim['remote_request_id']}")  # the decode waits in its queue
        wait_until(lambda: _metric(worker, "prefill_worker_vllm_heartbeats_total") > 0, 10)
        held = _staging_used(worker)
        thief.notify(f"{victim['remote_request_id']}:1")  # before: released the victim's blocks
        thief.notify(f"HB:{victim['remote_request_id']}")
        wait_until(lambda: _metric(worker, *FOREIGN) == before + 2, 10, "both counted")
        assert _staging_used(worker) == held  # nothing released
        blocks = victim["remote_block_ids"][0]
        got = decode.read(blocks, f"{victim['remote_request_id']}:1")
        assert got.any()  # the victim's own KV (test_vllm_pull.py checks the bytes)
        decode.read(first["remote_block_ids"][0], f"{first['remote_request_id']}:1")
        wait_until(lambda: _staging_used(worker) == 0, 10.0, "the reads' release")
    finally:
        thief.close()


def test_a_pull_cannot_take_a_native_requests_room(pulled) -> None:
    worker, api, _ = pulled
    ledger = Ledger()
    router, decode = Router(worker.ingress, ledger), LiveDecode(worker.bootstrap)
    try:
        room = 4_242_424_242
        rid = router.send_prefill(prompt(9, seed=21), room)  # native, waiting for its decode
        body = {"model": MODEL, "prompt": prompt(9, seed=22), "max_tokens": 1}
        body |= {"kv_transfer_params": PROXY_ASK, "bootstrap_room": room}
        request = urllib.request.Request(
            f"{api}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=patient(60))
        assert refused.value.code == 400 and b"bootstrap_room" in refused.value.read()
        decode.want(room, 9)  # the native request's own decode (before: its room was failed)
        reply = router.wait([rid])[rid]
        assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
        assert decode.wait([room])[room].state is RoomState.DONE
        decode.release(room)
    finally:
        router.close()
        decode.close()
