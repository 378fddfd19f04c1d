"""The router protocol's codec at its edges: what ``prefill_message`` carries, how token ids
of any container pack, and the words a worker frame is refused with (found unpinned by
mutation testing, `make mutation`)."""

from __future__ import annotations

from array import array

import msgpack
import numpy as np
import pytest

from prefill_worker.ingress.messages import (
    ProtocolError,
    decode_worker,
    encode,
    pack_tokens,
    prefill_message,
)
from prefill_worker.ingress.validate import Limits, decode_router
from prefill_worker.request import PrefillRequest

LIMITS = Limits(vocab_size=1000, max_prompt_tokens=64, max_pool_tokens=64)
EXPECTED = b"\x01\x00\x00\x00\x02\x00\x00\x00\xe7\x03\x00\x00"  # 1, 2, 999 as LE int32


@pytest.mark.parametrize(
    "token_ids",
    [
        [1, 2, 999],
        range(0),
        array("i", [1, 2, 999]),
        array("q", [1, 2, 999]),  # int64: repacked, never sent as 8-byte values
        array("H", [1, 2, 999]),
        np.array([1, 2, 999], dtype=np.int64),
        np.array([1, 2, 999], dtype=">i4"),
    ],
)
def test_every_container_packs_as_little_endian_int32(token_ids: object) -> None:
    packed = pack_tokens(token_ids)
    assert packed == (EXPECTED if len(token_ids) else b"")  # type: ignore[arg-type]


def test_prefill_message_carries_the_logprob_start_to_the_worker() -> None:
    msg = prefill_message("r", [1, 2, 3], 7, return_logprob=True, logprob_start_len=1)
    assert msg.logprob_start_len == 1
    got = decode_router(encode(msg), LIMITS)
    assert isinstance(got, PrefillRequest) and got.prompt_logprob_start == 1
    without = decode_router(encode(prefill_message("r", [1, 2, 3], 7)), LIMITS)
    assert isinstance(without, PrefillRequest) and without.prompt_logprob_start is None


def test_a_worker_frame_that_breaks_the_contract_says_how() -> None:
    with pytest.raises(ProtocolError, match=r"^v must be 1, got 2$"):
        decode_worker(msgpack.packb({"v": 2, "type": "reject", "code": "draining", "message": ""}))
    with pytest.raises(ProtocolError, match="Expected `object`, got `int`"):
        decode_worker(msgpack.packb(5))
    with pytest.raises(ProtocolError, match=r"^Input data was truncated$"):
        decode_worker(b"\x82\xa1v")
