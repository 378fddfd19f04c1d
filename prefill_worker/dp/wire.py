"""The link between the DP leader and each of its attention ranks: what travels, as msgpack.

One ZMQ DEALER per rank (``rank.py``) to the leader's ROUTER (``relay.py``), on a Unix socket
in a directory only the worker's user may enter (mode 0700). The engine's own vocabulary
travels (``PrefillRequest``, ``AbortRequest``, ``Outcome``, ``LoadSnapshot``), encoded by
msgspec (never pickle)::

    leader → rank   submit (a request placed on it), cancel (a router's abort), stop (drain)
    rank → leader   ready (its endpoints, once serving), done (one outcome), load (a snapshot)
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

import msgspec

from prefill_worker.load import LoadSnapshot
from prefill_worker.request import AbortRequest, Outcome, PrefillRequest


class Submit(msgspec.Struct, tag="submit", frozen=True):
    request: PrefillRequest


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    abort: AbortRequest


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


class Ready(msgspec.Struct, tag="ready", frozen=True):
    endpoints: dict[str, Any]


class Done(msgspec.Struct, tag="done", frozen=True):
    outcome: Outcome


class Load(msgspec.Struct, tag="load", frozen=True):
    load: LoadSnapshot


ToRank = Submit | Cancel | Stop
ToLeader = Ready | Done | Load

_encoder = msgspec.msgpack.Encoder()
_to_rank = msgspec.msgpack.Decoder(ToRank)
_to_leader = msgspec.msgpack.Decoder(ToLeader)


def encode(message: ToRank | ToLeader) -> bytes:
    if isinstance(message, Submit):  # token ids travel as a list (array is not msgpack)
        request = dataclasses.replace(message.request, token_ids=list(message.request.token_ids))
        message = Submit(request)
    return _encoder.encode(message)


def decode_to_rank(frame: bytes) -> ToRank:
    message = _to_rank.decode(frame)
    if isinstance(message, Submit):  # the engine's prompt type, as the ingress hands it over
        ids = array("i", message.request.token_ids)
        return Submit(dataclasses.replace(message.request, token_ids=ids))
    return message


def decode_to_leader(frame: bytes) -> ToLeader:
    return _to_leader.decode(frame)
