"""``StateGuard``: a protocol that cannot carry a hybrid model's state refuses each room when
its decode claims it, with the typed reason, before anything is sent; an unclaimed room is
left as it is (its bootstrap deadline still applies) and the rest of the seam passes through."""

from __future__ import annotations

from typing import ClassVar

import pytest

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.state_guard import STATE_UNSUPPORTED, StateGuard, refusal
from tests.unit.scheduler.fakes import FakeBackend

REASON = refusal("native", ("linear_state",))


class Bound(FakeBackend):
    """The fake backend with addresses and a poll time, for the pass-through checks."""

    bootstrap_endpoint = "tcp://127.0.0.1:5"
    endpoints: ClassVar[dict[str, str]] = {"bootstrap": "tcp://127.0.0.1:5"}

    def next_poll_at(self) -> float:
        return 12.5


def guarded(auto_want: bool) -> tuple[FakeBackend, StateGuard]:
    inner = Bound(PagePool(8), AuxPool(2), auto_want=auto_want)
    return inner, StateGuard(inner, REASON)


def test_a_claimed_room_fails_with_the_typed_reason_and_nothing_is_sent() -> None:
    inner, guard = guarded(auto_want=True)
    sender = guard.create_sender(7, "r", 12)
    assert sender.poll() is KVPoll.FAILED
    assert sender.failure_reason() == REASON and REASON.startswith(STATE_UNSUPPORTED + ":")
    assert "native protocol carries no linear_state state" in REASON
    fake = inner.senders["r"]
    assert fake.worker_failure == REASON and not fake.sent and not fake.aux
    assert sender.poll() is KVPoll.FAILED  # stays failed
    with pytest.raises(AssertionError):
        sender.send_pages([0], 0)
    with pytest.raises(AssertionError):
        sender.send_aux(0)
    sender.close()
    assert fake.is_closed


def test_an_unclaimed_room_waits_and_the_backend_passes_through() -> None:
    inner, guard = guarded(auto_want=False)
    sender = guard.create_sender(8, "r", 12)
    assert sender.poll() is KVPoll.BOOTSTRAPPING
    assert inner.senders["r"].worker_failure is None
    assert guard.bootstrap_endpoint == inner.bootstrap_endpoint
    assert guard.endpoints == inner.endpoints
    assert guard.next_poll_at() == 12.5
    assert (sender.num_cached_tokens(), sender.transfer_stats().bytes) == (0, 0)
    assert sender.why_no_handshake() == inner.senders["r"].why_no_handshake()
    inner.claimed = [8]
    assert guard.take_claimed_rooms() == [8] and guard.take_claimed_rooms() == []
    guard.poll()
    guard.wait(0.0)
    assert (inner.num_polls, inner.num_waits) == (1, 1)
    sender.fail("router gone")
    assert inner.senders["r"].worker_failure == "router gone"
    guard.close()


def test_every_protocol_but_native_is_guarded() -> None:
    """Native carries the state (its backend is left as it is); SGLang and vLLM do not."""
    from prefill_worker.transfer.state_guard import guard_backends

    native, sglang, vllm = object(), object(), object()  # nothing of them is called
    backends = {"native": native, "sglang": sglang, "vllm": vllm}
    guarded, refused = guard_backends(backends, "linear_state")  # type: ignore[arg-type]
    assert refused == ["sglang", "vllm"] and guarded["native"] is native
    for name, inner in (("sglang", sglang), ("vllm", vllm)):
        wrapped = guarded[name]
        assert isinstance(wrapped, StateGuard) and wrapped.inner is inner
        assert wrapped.reason == refusal(name, ("linear_state",))
        assert wrapped.reason.startswith(f"{STATE_UNSUPPORTED}: the {name} protocol carries no")
    assert guard_backends({"native": native}, "linear_state") == ({"native": native}, [])  # type: ignore[arg-type, dict-item]


def test_sglang_is_left_alone_when_it_carries_the_state() -> None:
    """A hybrid linear-attention model whose state SGLang decodes take staged (``mamba``)."""
    from prefill_worker.transfer.state_guard import STATE_CARRIERS, guard_backends

    native, sglang, vllm = object(), object(), object()
    backends = {"native": native, "sglang": sglang, "vllm": vllm}
    carriers = STATE_CARRIERS | {"sglang"}
    guarded, refused = guard_backends(backends, "linear_state", carriers)  # type: ignore[arg-type]
    assert refused == ["vllm"] and guarded["sglang"] is sglang and guarded["native"] is native
