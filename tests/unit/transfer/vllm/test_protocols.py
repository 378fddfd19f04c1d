"""Three protocols from one pool: ``transfer.protocol`` names any of native, sglang and vllm;
a room with a vLLM ticket goes to the vLLM sender at once (the others are failed and closed),
a room without one to whichever decode claims it (the vLLM sender holds no staging)."""

from __future__ import annotations

import pytest

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.service.config import ConfigError, load_config
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.dual import DualSender
from prefill_worker.transfer.vllm.desk import PullDesk
from prefill_worker.transfer.vllm.sender import VllmSender
from tests.clocks import FakeClock
from tests.polling import wait_until
from tests.unit.scheduler.fakes import FakeBackend, FakeSender
from tests.unit.transfer.vllm.test_sender import BLOCKS, _desk

HTTP = "http_api.enabled=true"


@pytest.mark.parametrize(
    ("protocol", "served"),
    [
        ("both", ("native", "sglang")),
        ("vllm,native", ("native", "vllm")),
        ("sglang, vllm, native", ("native", "sglang", "vllm")),
    ],
)
def test_protocol_names_any_of_the_three(protocol: str, served: tuple[str, ...]) -> None:
    config = load_config(None, env={}, overrides=[f"transfer.protocol={protocol}", HTTP])
    assert config.transfer.protocols == served


@pytest.mark.parametrize("protocol", ["mooncake", "native,native", "both,sglang", ""])
def test_unknown_or_repeated_protocols_are_refused(protocol: str) -> None:
    with pytest.raises(ConfigError, match="protocol"):
        load_config(None, env={}, overrides=[f"transfer.protocol={protocol}", HTTP])


def test_vllm_needs_the_http_front() -> None:
    with pytest.raises(ConfigError, match=r"http_api\.enabled"):
        load_config(None, env={}, overrides=["transfer.protocol=vllm"])


def _three(room: int) -> tuple[DualSender, FakeSender, FakeSender, VllmSender, PullDesk]:
    desk, _ = _desk(FakeClock(100.0))
    native = FakeBackend(PagePool(8), AuxPool(2)).create_sender(room, "r", 40)
    sglang = FakeBackend(PagePool(8), AuxPool(2)).create_sender(room, "r", 40)
    vllm = VllmSender(desk, room, 40)
    dual = DualSender([native, sglang, vllm], ["native", "sglang", "vllm"])
    return dual, native, sglang, vllm, desk


def test_a_ticketed_room_goes_to_vllm_and_the_others_close() -> None:
    dual, native, sglang, _, desk = _three(9)
    assert desk.tickets.open(9)
    assert dual.poll() is KVPoll.READY and dual.num_cached_tokens() == 0
    for other in (native, sglang):
        assert other.is_closed
        assert other.failure_reason() == "the room was taken by a decode on the vllm protocol"
    dual.send_pages([0, 1, 2], 0)
    dual.send_aux(0)
    wait_until(lambda: dual.poll().is_terminal, what="the repack ends")
    assert dual.poll() is KVPoll.SUCCESS
    dual.close()
    assert desk.staging.num_free == BLOCKS - 2 and len(desk.holds) == 1


def test_a_room_claimed_elsewhere_leaves_the_staging_whole() -> None:
    dual, native, sglang, vllm, desk = _three(9)
    assert dual.poll() is KVPoll.BOOTSTRAPPING
    sglang.want(num_cached_tokens=0)
    assert dual.poll() is KVPoll.READY
    assert vllm.poll() is KVPoll.FAILED and native.is_closed
    desk.tickets.open(9)  # a ticket now (a reused room) cannot revive a failed sender
    assert vllm.poll() is KVPoll.FAILED
    dual.close()
    assert desk.staging.num_free == BLOCKS and len(desk.holds) == 0


class _Backend:
    """A backend seam that records what the composition asks of it."""

    def __init__(self, name: str, next_at: float, fails_close: bool = False) -> None:
        self.bootstrap_endpoint = f"tcp://{name}"
        self.endpoints = {name: f"tcp://{name}"}
        self.next_at, self.fails_close = next_at, fails_close
        self.waited: list[float] = []
        self.is_closed = False

    def create_sender(self, *args: object, **kwargs: object) -> FakeSender:
        raise NotImplementedError

    def poll(self) -> None:
        pass

    def next_poll_at(self) -> float:
        return self.next_at

    def wait(self, timeout_s: float, wake_fd: int | None = None) -> None:
        self.waited.append(timeout_s)

    def close(self) -> None:
        self.is_closed = True
        if self.fails_close:
            raise RuntimeError(f"{self.endpoints} would not close")


def test_three_backends_sleep_in_the_first_and_all_close() -> None:
    from prefill_worker.transfer.dual import DualBackend

    native, sglang, vllm = _Backend("n", 50.0, True), _Backend("s", 40.0), _Backend("v", 10.02)
    dual = DualBackend({"native": native, "sglang": sglang, "vllm": vllm}, clock=lambda: 10.0)
    assert dual.endpoints == {"n": "tcp://n", "s": "tcp://s", "v": "tcp://v"}
    assert dual.next_poll_at() == 10.02
    dual.wait(1.0)
    assert native.waited == [pytest.approx(0.02)] and not sglang.waited and not vllm.waited
    with pytest.raises(RuntimeError, match="would not close"):
        dual.close()
    assert native.is_closed and sglang.is_closed and vllm.is_closed
