"""Optimistic prefill on a real worker process (issue #29): a real decode (``LiveDecode`` over
NIXL) that claims its room only after the prefill finished gets every page and the aux row;
one that claims after the hold bound gets a retried prefill whose full pages came from the
worker's prefix cache. Each on a worker of its own (a hold that outlasts any claim, and one
that is over before the claim is sent), one request each; each ends with ``check_healthy``.

No step races a timer: the first claim is sent well inside a long hold and bootstrap timeout,
and the second only once the worker says its prefill has yielded."""

from __future__ import annotations

from collections.abc import Callable

from prefill_worker.ingress.messages import Result
from prefill_worker.request import OutcomeStatus
from prefill_worker.transfer import RoomState
from tests.checkpoints import prompt
from tests.polling import wait_until
from tests.reliability.conftest import Rig, check_healthy

RETRIES = "prefill_worker_prefill_retries_total"  # counted with each request's outcome
PREFILLING = ("prefill_worker_queue_requests", {"state": "prefilling"})
BOOTSTRAPPING = ("prefill_worker_queue_requests", {"state": "bootstrapping"})
CACHED_PAGES = "prefill_worker_prefix_cache_pages"
OPTIMISTIC = (
    "scheduler.optimistic_prefill=true",
    "scheduler.optimistic_attempts=1",
    "cache.prefix_caching=true",
    "scheduler.bootstrap_timeout_s=120",  # bounds the hold and the claim: never reached here
)


def _claim_late(rig: Rig, num_tokens: int, seed: int) -> Result:
    """Send a prefill, let it finish before the decode claims, then claim: the result."""
    room = rig.next_room()
    cached = rig.metric(CACHED_PAGES)
    rid = rig.router.send_prefill(prompt(num_tokens, seed=seed), room)
    _wait_computed(rig, cached)
    assert rig.metric(*PREFILLING) == 1  # held (not still computing: its pages are cached)
    return _claim(rig, room, rid, num_tokens)


def _wait_computed(rig: Rig, cached: float) -> None:
    """The one request's forward is done: its full pages are in the prefix cache (committed
    as the chunk ends), reported in the same turn as its queue state, which is no longer
    BOOTSTRAPPING: from then on only a yield brings it back there."""
    wait_until(lambda: rig.metric(CACHED_PAGES) > cached, 30, "the prefill's pages cached")


def _claim(rig: Rig, room: int, rid: str, num_tokens: int) -> Result:
    rig.decode.want(room, num_tokens)
    reply = rig.router.wait([rid])[rid]
    assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
    assert rig.decode.wait([room])[room].state is RoomState.DONE
    rig.decode.release(room)
    return reply


def test_a_late_claim_gets_the_held_prefill(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(*OPTIMISTIC, "scheduler.optimistic_hold_s=120")
    held = _claim_late(rig, 14, seed=1)
    assert held.prefill_retries is not None and not held.prefill_retries  # UNSET: none
    assert rig.metric(RETRIES) == 0
    check_healthy(rig)


def test_a_claim_after_the_hold_bound_gets_a_retried_prefill_and_a_cache_hit(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory(*OPTIMISTIC, "scheduler.optimistic_hold_s=0.5")
    cached = rig.metric(CACHED_PAGES)
    room = rig.next_room()
    rid = rig.router.send_prefill(prompt(14, seed=2), room)
    _wait_computed(rig, cached)
    wait_until(lambda: rig.metric(*BOOTSTRAPPING) == 1, 30, "the held prefill yielded")
    retried = _claim(rig, room, rid, 14)
    assert retried.prefill_retries == 1 and rig.metric(RETRIES) == 1
    assert retried.num_prefix_hit_tokens == 12  # its 3 full pages stayed in the cache
    check_healthy(rig)
