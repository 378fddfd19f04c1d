"""The worker's ingress: where requests from routers (smg, Dynamo's router, your own) arrive.

Two fronts put into the one engine inbox (``prefill_worker.inbox``): the ZMQ front
(``zmq_front.Ingress``: a ROUTER socket speaking docs/protocol.md, part 1, with ``dispatch``,
``routes``, ``connections`` and ``replies`` on its I/O thread; ``header``, ``validate`` and
``messages`` decide what a frame is) and the SGLang-compatible HTTP front (``http/``).
Nothing here imports the scheduler: the inbox and the load snapshot are shared vocabulary.

Public for routers: ``RouterClient`` (asyncio), ``BlockingRouterClient`` and
``RequestRejected``, the client side of the ZMQ protocol. Exported lazily, so importing
``prefill_worker.ingress.messages`` stays free of ZMQ.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefill_worker.ingress.client import BlockingRouterClient, RequestRejected, RouterClient

_LAZY = {
    "BlockingRouterClient": "prefill_worker.ingress.client",
    "RequestRejected": "prefill_worker.ingress.client",
    "RouterClient": "prefill_worker.ingress.client",
}

__all__ = ["BlockingRouterClient", "RequestRejected", "RouterClient"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
