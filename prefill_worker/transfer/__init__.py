"""KV transfer to decode nodes: the backend seam (``base``), the push engine (``push/``), the
two protocols over NIXL (``native/``, ``sglang/``) and the decode SDK (``decode/``).

Public for decode engines: ``KVReceiver`` (with ``RoomState``, ``RoomStatus``,
``RegistrationError``), ``describe_worker`` (the worker's pool layout, before registering),
``describe_state`` and ``state_regions_from_tensors`` (a hybrid model's state pool),
``num_want_pages`` (how many pages a ``want`` names); for the daemon: ``make_backend``.
Exported lazily, so importing ``prefill_worker.transfer.base`` stays free of NIXL and ZMQ.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "KVReceiver": "prefill_worker.transfer.decode.receiver",
    "RoomState": "prefill_worker.transfer.decode.receiver",
    "RoomStatus": "prefill_worker.transfer.decode.receiver",
    "RegistrationError": "prefill_worker.transfer.decode.receiver",
    "describe_state": "prefill_worker.transfer.describe",
    "describe_worker": "prefill_worker.transfer.describe",
    "state_regions_from_tensors": "prefill_worker.transfer.decode.state_pool",
    "make_backend": "prefill_worker.transfer.factory",
    "num_want_pages": "prefill_worker.transfer.pagemap",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
