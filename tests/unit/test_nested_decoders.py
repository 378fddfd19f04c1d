"""Every decoder of peer msgpack refuses a value nested past ``MAX_DEPTH`` as malformed, with
its protocol's typed error, and never raises anything else (before: ``RecursionError`` from
msgspec for ~1000 levels, anywhere in the frame, an ignored key included)."""

from __future__ import annotations

import msgspec
import pytest

from prefill_worker.ingress.messages import (
    Ping,
    ProtocolError,
    Reject,
    RejectCode,
    decode_worker,
    encode,
)
from prefill_worker.ingress.validate import Limits, decode_router
from prefill_worker.msgpack_shape import MAX_DEPTH
from prefill_worker.transfer import wire

LIMITS = Limits(vocab_size=1000, max_prompt_tokens=64, max_pool_tokens=64)
_enc = msgspec.msgpack.encode


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def frame(pairs: dict[str, bytes]) -> bytes:
    """A msgpack map of already-encoded values."""
    return bytes([0x80 | len(pairs)]) + b"".join(_enc(k) + v for k, v in pairs.items())


PING = {"v": _enc(1), "type": _enc("ping")}
PREFILL = {
    "v": _enc(1),
    "type": _enc("prefill"),
    "request_id": _enc("r1"),
    "token_ids": _enc(bytes(8)),
    "bootstrap_room": _enc(7),
}


@pytest.mark.parametrize("depth", [MAX_DEPTH, 1000, 50_000])
@pytest.mark.parametrize(
    "where",
    [
        lambda v: frame({**PING, "x": v}),
        lambda v: frame({**PREFILL, "x": v}),
        lambda v: frame({**PREFILL, "sampling": b"\x81" + _enc("extra") + v}),
        lambda v: frame({**PREFILL, "token_ids": v}),
        lambda v: frame({**PING, "nonce": v}),
        lambda v: frame({"v": v, "type": _enc("ping")}),
        lambda v: frame({"v": _enc(1), "type": v}),
    ],
    ids=["ping extra", "prefill extra", "in sampling", "token_ids", "nonce", "v", "type"],
)
def test_the_router_ingress_refuses_deep_values(where, depth: int) -> None:
    """Where a scalar belongs, a shallow container is a type error on its header
    (``bad_field``, ``bad_version``); anything deeper than msgspec could skip is malformed."""
    got = decode_router(where(nested(depth)), LIMITS)
    assert isinstance(got, Reject), got
    assert got.code in (RejectCode.MALFORMED, RejectCode.BAD_FIELD, RejectCode.BAD_VERSION)
    if depth >= 1000:
        assert got.code is RejectCode.MALFORMED, got


@pytest.mark.parametrize("depth", [MAX_DEPTH, 1000, 50_000])
def test_an_ignored_key_nested_past_the_bound_is_malformed(depth: int) -> None:
    got = decode_router(frame({**PING, "x": nested(depth)}), LIMITS)
    assert isinstance(got, Reject) and got.code is RejectCode.MALFORMED, got
    assert f"nested at most {MAX_DEPTH} deep" in got.message


def test_an_ignored_key_within_the_bound_is_ignored() -> None:
    assert decode_router(frame({**PING, "x": nested(MAX_DEPTH - 2)}), LIMITS) == Ping()


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 50_000])
def test_the_bootstrap_wire_refuses_deep_values(depth: int) -> None:
    heartbeat = wire.encode(wire.Heartbeat())
    deep = bytes([heartbeat[0] + 1]) + heartbeat[1:] + _enc("x") + nested(depth)
    with pytest.raises(wire.WireError, match="nested deeper"):
        wire.decode(deep)
    assert wire.decode(bytes([heartbeat[0] + 1]) + heartbeat[1:] + _enc("x") + nested(3))


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1000, 50_000])
def test_the_router_client_refuses_deep_values(depth: int) -> None:
    pong = encode(Ping())  # any map the worker might send, with an extra key
    deep = bytes([pong[0] + 1]) + pong[1:] + _enc("x") + nested(depth)
    with pytest.raises(ProtocolError):
        decode_worker(deep)
