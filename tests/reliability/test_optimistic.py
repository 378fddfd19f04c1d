"""Optimistic prefill on a real worker process (issue #29): a real decode (``LiveDecode`` over
NIXL) that claims its room only after the prefill finished gets every page and the aux row;
one that claims after the hold bound gets a retried prefill whose full pages came from the
worker's prefix cache. One worker of its own, two requests; ends with ``check_healthy``."""

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


def _claim_late(rig: Rig, num_tokens: int, seed: int) -> Result:
    """Send a prefill, let it finish before the decode claims, then claim: the result."""
    room = rig.next_room()
    rid = rig.router.send_prefill(prompt(num_tokens, seed=seed), room)
    wait_until(lambda: rig.metric(*PREFILLING) == 1, 30, "the prefill done and held")
    return _claim(rig, room, rid, num_tokens)


def _claim(rig: Rig, room: int, rid: str, num_tokens: int) -> Result:
    rig.decode.want(room, num_tokens)
    reply = rig.router.wait([rid])[rid]
    assert isinstance(reply, Result) and reply.status is OutcomeStatus.OK, reply
    assert rig.decode.wait([room])[room].state is RoomState.DONE
    rig.decode.release(room)
    return reply


def test_a_late_claim_gets_the_held_prefill_and_a_later_one_a_cache_hit(
    rig_factory: Callable[..., Rig],
) -> None:
    rig = rig_factory(
        "scheduler.optimistic_prefill=true",
        "scheduler.optimistic_attempts=1",
        "scheduler.optimistic_hold_s=0.5",
        "cache.prefix_caching=true",
    )
    held = _claim_late(rig, 14, seed=1)
    assert held.prefill_retries is not None and not held.prefill_retries  # UNSET: none
    room = rig.next_room()
    rid = rig.router.send_prefill(prompt(14, seed=2), room)
    wait_until(lambda: rig.metric(*PREFILLING) == 1, 30, "the prefill done and held")
    wait_until(lambda: rig.metric(*BOOTSTRAPPING) == 1, 30, "the held prefill yielded")
    retried = _claim(rig, room, rid, 14)
    assert retried.prefill_retries == 1 and rig.metric(RETRIES) == 1
    assert retried.num_prefix_hit_tokens == 12  # its 3 full pages stayed in the cache
    check_healthy(rig)
