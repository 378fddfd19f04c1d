"""The HTTP front's side of vLLM pulls, over real HTTP on 127.0.0.1 with the engine played by
a thread: a proxy-shaped ``/v1/completions`` (``kv_transfer_params.do_remote_decode``, no
room) gets its room a ticket and its answer the params the backend recorded; the ticket is
closed whatever happens; a worker not serving vLLM refuses with 400; a batch is refused."""

from __future__ import annotations

import json
import queue
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from prefill_worker.ingress.http import HttpApi, ServedModel
from prefill_worker.ingress.http.bodies import BadRequest, read_completion
from prefill_worker.ingress.http.pull import open_pulls
from prefill_worker.ingress.validate import Limits
from prefill_worker.load import LoadSnapshot
from prefill_worker.request import FinishReason, Outcome, OutcomeStatus, PrefillRequest
from prefill_worker.transfer.vllm.tickets import Tickets

PROXY_ASK = {  # what vLLM's toy proxy and llm-d's sidecar put in the prefill request
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MODEL = ServedModel(
    "tiny", "/m", ("LlamaForCausalLM",), "llama", 512, 16, 4096, 8, "0", None, False
)


def test_a_pull_body_gets_a_room_and_is_marked() -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "stream": False, "kv_transfer_params": PROXY_ASK}
    (one,) = read_completion(json.dumps(body).encode(), 8)
    (two,) = read_completion(json.dumps(body).encode(), 8)
    assert one.is_pull and 0 <= one.bootstrap_room < 2**63
    assert one.bootstrap_room != two.bootstrap_room
    plain = read_completion(json.dumps({"prompt": [1], "bootstrap_room": 5}).encode(), 8)
    assert not plain[0].is_pull
    with pytest.raises(BadRequest, match="not a batch"):
        read_completion(json.dumps({**body, "prompt": [[1], [2]]}).encode(), 8)
    with pytest.raises(BadRequest, match="names none"):  # a room is one request's
        read_completion(json.dumps({**body, "bootstrap_room": 5}).encode(), 8)


def test_a_room_has_one_ticket() -> None:
    tickets = Tickets(4)
    assert tickets.open(7) and not tickets.open(7)  # a second pull on the room: refused
    assert len(tickets) == 1 and tickets.take(7) is None
    assert tickets.open(7)  # free again once taken


class Engine(threading.Thread):
    """Takes requests; a ticketed room gets params, as the vLLM sender records them."""

    def __init__(self, inbox: queue.Queue[Any], tickets: Tickets, front: HttpApi) -> None:
        super().__init__(daemon=True)
        self.inbox, self.tickets, self.front = inbox, tickets, front
        self.seen_open: list[bool] = []
        self.seen_versions: list[str | None] = []

    def run(self) -> None:
        while (req := self.inbox.get()) is not None:
            if not isinstance(req, PrefillRequest):
                continue
            is_open = self.tickets.is_open(req.bootstrap_room)
            self.seen_open.append(is_open)
            self.seen_versions.append(self.tickets.version_of(req.bootstrap_room))
            if is_open:
                self.tickets.complete(req.bootstrap_room, {"remote_request_id": "pw-1"})
            n = len(req.token_ids)
            ok = Outcome(req.request_id, OutcomeStatus.OK, FinishReason.OK, n, first_token_id=7)
            self.front.send_outcome(ok)


@pytest.fixture
def served() -> Iterator[tuple[str, Tickets, Engine]]:
    inbox: queue.Queue[Any] = queue.Queue()
    tickets = Tickets(4)
    front = HttpApi(
        "127.0.0.1:0", inbox, LoadSnapshot, Limits(100, 512, 4096), MODEL, None,
        max_inflight=4, max_body_bytes=1 << 20, tickets=tickets,
    )  # fmt: skip
    engine = Engine(inbox, tickets, front)
    engine.start()
    front.start()
    front.set_ready(True)
    yield f"http://127.0.0.1:{front.port}", tickets, engine
    front.stop()
    inbox.put(None)
    engine.join(5)


def _post(url: str, body: object) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_answer_carries_the_params_and_the_ticket_closes(
    served: tuple[str, Tickets, Engine],
) -> None:
    url, tickets, engine = served
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": PROXY_ASK}
    status, answer = _post(f"{url}/v1/completions", body)
    assert status == 200, answer
    assert answer["kv_transfer_params"] == {"remote_request_id": "pw-1"}
    assert answer["choices"][0]["finish_reason"] == "length"
    assert engine.seen_open == [True] and len(tickets) == 0
    status, plain = _post(f"{url}/v1/completions", {"prompt": [1], "bootstrap_room": 3})
    assert status == 200 and "kv_transfer_params" not in plain


def test_a_pull_names_its_decodes_vllm_version_or_gets_the_default(
    served: tuple[str, Tickets, Engine],
) -> None:
    """The ticket records the version asked (its answer names that version's side channel);
    none asked: the first served; one not served (or unknown) is refused 400 with the
    versions served, and no ticket stays open."""
    url, tickets, engine = served
    body = {"prompt": [1, 2, 3], "max_tokens": 1}
    for version in ("0.34.0", None, "0.33.0"):
        ask = {**PROXY_ASK, "vllm_version": version}
        status, answer = _post(f"{url}/v1/completions", {**body, "kv_transfer_params": ask})
        assert status == 200, answer
    assert engine.seen_versions == ["0.34.0", "0.33.0", "0.33.0"]
    for version in ("0.32.0", "0.34"):
        ask = {**PROXY_ASK, "vllm_version": version}
        status, answer = _post(f"{url}/v1/completions", {**body, "kv_transfer_params": ask})
        assert status == 400, answer
        assert f"vLLM {version}" in json.dumps(answer)
        assert "serves vLLM 0.33.0, 0.34.0" in json.dumps(answer)
    assert len(engine.seen_versions) == 3 and len(tickets) == 0


def test_a_worker_of_one_version_refuses_the_other() -> None:
    tickets = Tickets(4, ("0.34.0",))
    assert tickets.open(1) and tickets.version_of(1) == "0.34.0"
    assert tickets.take(1) is None and tickets.version_of(1) is None
    with pytest.raises(BadRequest, match=re.escape("serves vLLM 0.34.0")):
        body = {"prompt": [1], "kv_transfer_params": {**PROXY_ASK, "vllm_version": "0.33.0"}}
        open_pulls(tickets, read_completion(json.dumps(body).encode(), 8))
    assert len(tickets) == 0


def test_a_worker_without_vllm_refuses_a_pull() -> None:
    front = HttpApi(
        "127.0.0.1:0", queue.Queue(), LoadSnapshot, Limits(100, 512, 4096), MODEL, None,
        max_inflight=4, max_body_bytes=1 << 20,
    )  # fmt: skip
    front.start()
    front.set_ready(True)
    try:
        body = {"prompt": [1, 2], "kv_transfer_params": PROXY_ASK}
        status, answer = _post(f"http://127.0.0.1:{front.port}/v1/completions", body)
    finally:
        front.stop()
    assert status == 400 and "does not serve vLLM decodes" in json.dumps(answer)
