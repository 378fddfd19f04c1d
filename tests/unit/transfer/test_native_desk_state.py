"""The native desk of a hybrid model: a decode's state pool is admitted when its component is
the worker's (its slot count may differ) and its list prepared under the decode's name; one
that differs is refused ``layout_mismatch`` before NIXL sees the decode; a decode without a
pool registers (its wants are refused later, ``state_unsupported``); a model without state
ignores a pool it is offered; a pool NIXL cannot address refuses the registration and
forgets the agent."""

from __future__ import annotations

import dataclasses

import pytest

from prefill_worker.transfer import wire
from prefill_worker.transfer.native.desk import BootstrapDesk
from prefill_worker.transfer.validate import BootstrapLimits, RejectReason
from tests.unit.transfer.test_native_desk import DESCRIBED, LAYOUT, Desk, registered
from tests.unit.transfer.test_push_state import COMPONENT, CONV, DECODE


class StateDesk(Desk):
    def __init__(self, has_state: bool = True) -> None:
        super().__init__()
        self.desk = BootstrapDesk(
            self.hub,
            self.server,  # type: ignore[arg-type]
            self.agent,
            LAYOUT,
            BootstrapLimits(),
            DESCRIBED,
            state=COMPONENT if has_state else None,
        )


def pool(**changes: object) -> wire.StatePool:
    component = dataclasses.replace(DECODE.component, **changes)  # type: ignore[arg-type]
    return wire.StatePool.of(component, DECODE.base_addrs)


def test_a_matching_state_pool_is_prepared_beside_the_kv() -> None:
    d = StateDesk()
    assert d.register(b"c1", state=(pool(),)) == registered(None)
    peer = d.hub.peers[b"c1"]
    assert peer.state is not None and peer.state.regions == DECODE
    assert d.agent.prepped == ["decode-1", "decode-1", "decode-1"]  # KV, aux, state


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ((), "register names 0 linear_state state pools; one is needed"),
        ((pool(), pool()), "register names 2 linear_state state pools; one is needed"),
        ((pool(kind="swa"),), "register names 0 linear_state state pools"),
        ((pool(layer_ids=(0, 2, 4)),), "state layout mismatch: linear_state: layers [0, 2, 4]"),
    ],
)
def test_a_state_pool_that_differs_is_refused(state: tuple[wire.StatePool, ...], why: str) -> None:
    d = StateDesk()
    waiting = d.hub.create_sender(7, "req-7", 16, allowed_peer="decode-1")
    answer = d.register(b"c1", state=state)
    assert not answer.is_ok and str(answer.reason).startswith(why), answer.reason
    assert d.server.sent[-1][0] == b"c1"  # told on its own connection
    assert not d.hub.peers and not d.agent.added
    assert d.hub.counter.counts == {RejectReason.LAYOUT_MISMATCH.value: 1}
    # the rooms the router named for that decode fail now: it will never ask for them
    assert str(waiting.failure_reason()).startswith("registration refused: ")
    assert d.hub.refusals.names.get("decode-1", d.rig.now) is not None


def test_a_tensor_that_differs_is_refused() -> None:
    d = StateDesk()
    other = wire.StatePool.of(
        dataclasses.replace(DECODE.component, tensors=(CONV, CONV)), DECODE.base_addrs
    )
    answer = d.register(b"c1", state=(other,))
    assert not answer.is_ok and "state layout mismatch: linear_state: tensors" in str(answer.reason)


def test_a_decode_without_a_state_pool_registers() -> None:
    d = StateDesk()
    assert d.register(b"c1") == registered(None)
    assert d.hub.peers[b"c1"].state is None and d.agent.prepped == ["decode-1"] * 2


def test_a_model_without_state_ignores_an_offered_pool() -> None:
    d = StateDesk(has_state=False)
    assert d.register(b"c1", state=(pool(),)) == registered(None)
    assert d.hub.peers[b"c1"].state is None and d.agent.prepped == ["decode-1"] * 2


def test_a_state_pool_nixl_cannot_address_refuses_the_registration() -> None:
    d = StateDesk()
    prep = d.agent.prep_xfer_dlist
    calls: list[str] = []

    def third_refused(name: str, table: object, mem_type: str):  # type: ignore[no-untyped-def]
        calls.append(name)
        if len(calls) == 3:
            d.agent.refuse_prep = True
        return prep(name, table, mem_type)

    d.agent.prep_xfer_dlist = third_refused  # type: ignore[method-assign]
    waiting = d.hub.create_sender(7, "req-7", 16, allowed_peer="decode-1")
    answer = d.register(b"c1", state=(pool(),))
    assert not answer.is_ok and d.server.sent[-1][0] == b"c1"
    assert str(answer.reason).startswith("NIXL cannot address the decode's state pool")
    assert str(waiting.failure_reason()).startswith("registration refused: NIXL cannot")
    assert not d.hub.peers and d.agent.removed == ["decode-1"]
    assert d.hub.counter.counts == {RejectReason.NIXL_REFUSED.value: 1}
