"""Bootstrap v1 compatibility: frames recorded from the v1 codec (``v1_bootstrap_frames.json``,
never regenerated) decode to the same messages, and encoding those gives the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import wire

FRAMES = json.loads((Path(__file__).parent / "v1_bootstrap_frames.json").read_text())
LAYOUT = KVLayout(2, 4, 64, "bfloat16", 16, 100)
REGIONS = KVRegions(LAYOUT, (1 << 40, 2 << 40), (3 << 40, 4 << 40), "cuda:1", 5 << 40, 64)

EXPECTED: dict[str, wire.Message] = {
    "register": wire.Register.of(
        "decode-a", wire.frame_metadata(b"nixl-md"), REGIONS, LAYOUT.compat_hash()
    ),
    "want": wire.Want.of(2**63 - 1, (5, 0, 99, 2**31 - 1), 3, 32),
    "want_empty": wire.Want.of(1, (), 0, 0),
    "abort": wire.Abort(7),
    "heartbeat": wire.Heartbeat(),
    "bye": wire.Bye(),
    "registered_ok": wire.Registered(
        is_ok=True, agent_name="prefill-x", heartbeat_interval_s=1.0, peer_timeout_s=10.0
    ),
    "registered_refused": wire.Registered(
        is_ok=False,
        reason="KV layout mismatch: x",
        agent_name="prefill-x",
        heartbeat_interval_s=0.5,
        peer_timeout_s=30.0,
    ),
    "status_ok": wire.Status(9, "ok"),
    "status_failed_reason": wire.Status(9, "failed", "peer silent"),
    "status_aborted": wire.Status(10, "aborted", "aborted by decode"),
    "status_code": wire.Status(9, "failed", "decode peer not registered", "unknown_peer"),
    "reject": wire.Reject("not a msgpack message"),
    "unknown_peer": wire.UnknownPeer("decode peer not registered"),
}


def test_every_kind_is_recorded() -> None:
    assert set(EXPECTED) == set(FRAMES) - {"_note"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_v1_frame_decodes_to_the_same_message(name: str) -> None:
    assert wire.decode(bytes.fromhex(FRAMES[name])) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_encoder_writes_the_v1_bytes(name: str) -> None:
    assert wire.encode(EXPECTED[name]).hex() == FRAMES[name]


def test_recorded_register_carries_its_regions() -> None:
    msg = wire.decode(bytes.fromhex(FRAMES["register"]))
    assert isinstance(msg, wire.Register) and msg.regions == REGIONS
    assert wire.unframe_metadata(msg.metadata) == b"nixl-md"
