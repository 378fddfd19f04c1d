"""A draft on the native protocol, CPU only: ``register.draft`` on the wire (its addresses
checked at decode, absent from v1 bytes when unset) and the native desk with a draft
(``native.draft.decode_draft``): a decode that registered this worker's draft is written
with the draft's layers after the target's, one without or at a worker without a draft with
the target's alone, one whose draft differs is refused naming both. Over real NIXL:
tests/integration/transfer/test_draft_transfer.py."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.kv.layout import KVRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.draft import DraftSide
from prefill_worker.transfer.native.desk import BootstrapDesk
from prefill_worker.transfer.validate import BootstrapLimits, RejectReason
from tests.unit.transfer.test_native_desk import DESCRIBED, LAYOUT, REGIONS, Desk, registered

ROWS = DraftRows(8, 16)  # 212-byte rows
OURS = DraftSide(
    KVRegions(dataclasses.replace(LAYOUT, num_layers=1), (6 << 20,), (7 << 20,), "cpu", 8, 8),
    ROWS,
)


def theirs(num_layers: int = 1, row_bytes: int = ROWS.row_bytes) -> wire.DraftPool:
    k = tuple((10 + i) << 20 for i in range(num_layers))
    v = tuple((20 + i) << 20 for i in range(num_layers))
    return wire.DraftPool(
        k_base_addrs=k, v_base_addrs=v, rows_base_addr=9 << 20, row_bytes=row_bytes
    )


class DraftDesk(Desk):
    def __init__(self, draft: DraftSide | None = OURS) -> None:
        super().__init__()
        self.desk = BootstrapDesk(
            self.hub,
            self.server,  # type: ignore[arg-type]
            self.agent,
            LAYOUT,
            BootstrapLimits(),
            DESCRIBED,
            draft=draft,
        )


def test_a_draft_pool_travels_in_register_and_is_checked() -> None:
    msg = wire.Register.of("d", b"md", REGIONS, "h", draft=theirs())
    assert wire.decode(wire.encode(msg)) == msg
    assert "draft" not in msgspec.msgpack.decode(
        wire.encode(wire.Register.of("d", b"md", REGIONS, "h"))
    )
    raw = msgspec.msgpack.decode(wire.encode(msg))
    raw["draft"]["v_base_addrs"] = [1, 2]  # two V for one layer
    with pytest.raises(wire.WireError, match=r"one address per layer .* - at `\$.draft`"):
        wire.decode(msgspec.msgpack.encode(raw))
    draft = theirs().regions(REGIONS)
    assert draft.layout == dataclasses.replace(LAYOUT, num_layers=1)
    assert (draft.aux_base_addr, draft.num_aux_rows, draft.device) == (9 << 20, 8, "cpu")


def test_a_decode_with_the_workers_draft_is_written_its_draft_layers_too() -> None:
    d = DraftDesk()
    assert d.register(b"c1", draft=theirs()) == registered(None)
    regions = d.hub.peers[b"c1"].regions
    assert regions.layout.num_layers == LAYOUT.num_layers + 1
    assert regions.k_base_addrs == (*REGIONS.k_base_addrs, 10 << 20)
    assert regions.v_base_addrs == (*REGIONS.v_base_addrs, 20 << 20)
    assert regions.aux_base_addr == REGIONS.aux_base_addr


@pytest.mark.parametrize(
    ("draft", "offered"),
    [(OURS, None), (None, theirs()), (None, None)],
    ids=["plain", "no-draft", "neither"],
)
def test_otherwise_the_target_alone(
    draft: DraftSide | None, offered: wire.DraftPool | None
) -> None:
    d = DraftDesk(draft)
    changes = {} if offered is None else {"draft": offered}
    assert d.register(b"c1", **changes) == registered(None)
    assert d.hub.peers[b"c1"].regions == REGIONS


@pytest.mark.parametrize(
    ("offered", "why"),
    [
        (theirs(num_layers=2), "the decode's draft pool has 2 layers and rows of 212 bytes"),
        (theirs(row_bytes=200), "the decode's draft pool has 1 layers and rows of 200 bytes"),
    ],
)
def test_a_draft_that_is_not_the_workers_is_refused(offered: wire.DraftPool, why: str) -> None:
    d = DraftDesk()
    answer = d.register(b"c1", draft=offered)
    assert not answer.is_ok and str(answer.reason).startswith(f"draft mismatch: {why}")
    assert "this worker's draft has 1 layers and rows of 212 bytes" in str(answer.reason)
    assert not d.hub.peers and not d.agent.added
    assert d.server.sent[-1][0] == b"c1"  # told on its own connection
    assert d.hub.refusals.names.get("decode-1", d.rig.now) is not None  # its rooms hear why
    assert d.hub.counter.counts == {RejectReason.LAYOUT_MISMATCH.value: 1}
