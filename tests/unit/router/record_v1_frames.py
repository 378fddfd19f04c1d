"""Records v1 frames with the hand-written codec of commit 50c9b29 into v1_frames.json.

Run once, before the codec was replaced: ``python tests/unit/router/record_v1_frames.py``.
Kept for provenance; it imports ``prefill_worker.protocol``, which no longer exists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
from prefill_worker.protocol import (  # type: ignore[import-not-found]
    AbortMsg,
    DrainMsg,
    LoadSnapshot,
    PingMsg,
    PongMsg,
    PrefillMsg,
    Reject,
    RejectCode,
    encode,
    encode_outcome,
)

from prefill_worker.request import FinishReason, Outcome, OutcomeStatus, SamplingParams, Timings


def _frames() -> dict[str, bytes]:
    timings = Timings(0.001, 0.25, 0.5, 0.125)
    full = PrefillMsg(
        "req-full",
        [1, 2, 3, 70000],
        2**62 + 5,
        SamplingParams(0.7, 0.9, 40, 1234),
        True,
        2.5,
        "decode-agent-0",
    )
    return {
        "prefill_full": encode(full),
        "prefill_minimal": encode(PrefillMsg("req-min", [5], 0)),
        "prefill_sampling_no_seed": encode(
            PrefillMsg("r3", [0, 1], 7, SamplingParams(1.0, 0.5, 0))
        ),
        "abort": encode(AbortMsg("req-full")),
        "ping_nonce": encode(PingMsg(42)),
        "ping": encode(PingMsg()),
        "drain_nonce": encode(DrainMsg(7)),
        "drain": encode(DrainMsg()),
        "result_ok_logprob": encode_outcome(
            Outcome("req-full", OutcomeStatus.OK, FinishReason.OK, 4, 2, 17, -0.5, None, timings)
        ),
        "result_ok_no_logprob": encode_outcome(
            Outcome("req-min", OutcomeStatus.OK, FinishReason.OK, 1, 0, 3, -0.25, None, timings),
            return_logprob=False,
        ),
        "result_failed": encode_outcome(
            Outcome(
                "r3",
                OutcomeStatus.FAILED,
                FinishReason.TRANSFER_TIMEOUT,
                2,
                0,
                None,
                None,
                "transfer_timeout: no decode claimed the room in 30 s",
                timings,
            )
        ),
        "result_aborted_scoped": encode_outcome(
            Outcome("ab/req", OutcomeStatus.ABORTED, FinishReason.ROUTER_GONE, 2),
            True,
            "req",
        ),
        "reject_with_id": encode(
            Reject(
                RejectCode.BAD_SAMPLING, "sampling.top_p must be in (0, 1]", "r9", "sampling.top_p"
            )
        ),
        "reject_no_id": encode(Reject(RejectCode.MALFORMED, "frame is not a msgpack map")),
        "reject_nonce": encode(Reject(RejectCode.FORBIDDEN, "drain is disabled", None, "type", 7)),
        "pong_nonce": encode(PongMsg(LoadSnapshot(3, 2, 100, False), 42)),
        "pong": encode(PongMsg(LoadSnapshot(0, 0, 0, True))),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def main() -> None:
    out = {
        name: {"hex": frame.hex(), "map": _jsonable(msgpack.unpackb(frame))}
        for name, frame in _frames().items()
    }
    path = Path(__file__).with_name("v1_frames.json")
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
