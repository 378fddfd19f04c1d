"""The words a router frame's header is refused with when ``v`` or ``type`` is an array or a
map: the container is named, never decoded into the text (found unpinned by mutation testing,
`make mutation`)."""

from __future__ import annotations

import msgspec
import pytest

from prefill_worker.ingress.messages import Reject, RejectCode
from prefill_worker.ingress.validate import Limits, decode_router

LIMITS = Limits(vocab_size=1000, max_prompt_tokens=64, max_pool_tokens=64)


@pytest.mark.parametrize("value", [[1], {"v": 1}, [[2, 3]]])
def test_a_container_version_is_named_not_decoded(value: object) -> None:
    got = decode_router(msgspec.msgpack.encode({"v": value, "type": "prefill"}), LIMITS)
    assert isinstance(got, Reject), got
    assert (got.code, got.field) == (RejectCode.BAD_VERSION, "v")
    assert got.message == "v must be 1, got an array or map"


@pytest.mark.parametrize("value", [["prefill"], {"t": "prefill"}])
def test_a_container_type_is_a_bad_field(value: object) -> None:
    got = decode_router(msgspec.msgpack.encode({"v": 1, "type": value}), LIMITS)
    assert isinstance(got, Reject), got
    assert (got.code, got.field, got.message) == (
        RejectCode.BAD_FIELD,
        "type",
        "type must be a string",
    )
