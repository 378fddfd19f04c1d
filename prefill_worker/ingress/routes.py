"""The requests in flight at the ingress: whose each one is, and where its reply goes.

Request ids are scoped by router connection: the engine sees ``"<routing id hex>/<request_id>"``,
unique in the worker, and the reply carries the router's own id again. So two routers may use
one id, and ``duplicate_request_id`` and ``abort`` concern only the sender's own ids: this table
is the one owner of that rule (the engine trusts it). Used by the ingress I/O thread only; no
ZMQ.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefill_worker.ingress.messages import Reject, RejectCode


@dataclass(frozen=True, slots=True)
class Route:
    identity: bytes  # the router's ZMQ routing id
    request_id: str  # the router's own id


class RouteTable:
    """Scoped id → ``Route``, and each router's scoped ids, for at most ``max_inflight``."""

    def __init__(self, max_inflight: int) -> None:
        self._max_inflight = max_inflight
        self._routes: dict[str, Route] = {}
        self._by_router: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._routes)

    def problem(self, scoped_id: str, request_id: str) -> Reject | None:
        """Why a router's ``prefill`` (its own id, and the id ``scope`` made of it) cannot be
        taken now, or None."""
        if scoped_id in self._routes:
            why = f"request_id {request_id!r} is already in flight on this connection"
            code = RejectCode.DUPLICATE_REQUEST_ID
            return Reject(code=code, message=why, request_id=request_id, field="request_id")
        if len(self._routes) >= self._max_inflight:
            why = f"{self._max_inflight} requests already in flight"
            return Reject(code=RejectCode.OVERLOADED, message=why, request_id=request_id)
        return None

    def add(self, identity: bytes, scoped_id: str, request_id: str) -> None:
        """File a request that ``problem`` allowed."""
        self._routes[scoped_id] = Route(identity, request_id)
        self._by_router.setdefault(identity, set()).add(scoped_id)

    def pop(self, scoped_id: str) -> Route | None:
        """The request's route, forgotten; None when it is not in flight."""
        route = self._routes.pop(scoped_id, None)
        if route is not None:
            in_flight = self._by_router[route.identity]
            in_flight.discard(scoped_id)
            if not in_flight:
                del self._by_router[route.identity]
        return route

    def find(self, identity: bytes, request_id: str) -> str | None:
        """The scoped id of this router's request, if it is in flight (an ``abort``)."""
        scoped_id = scoped(identity, request_id)
        return scoped_id if scoped_id in self._routes else None

    def of_router(self, identity: bytes) -> list[str]:
        return list(self._by_router.get(identity, ()))


def scope(identity: bytes) -> str:
    """What goes before a router's request id to make it worker-wide: hex has no '/', so the
    pair is recoverable. The ingress computes it once per routing id."""
    return f"{identity.hex()}/"


def scoped(identity: bytes, request_id: str) -> str:
    """The worker-wide id of a router's request."""
    return scope(identity) + request_id
