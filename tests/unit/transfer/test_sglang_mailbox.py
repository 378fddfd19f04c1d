"""The hand-over from the SGLang control thread to the engine: one turn takes at most a few
registrations (each costs NIXL work), and the pipe stays readable while anything is left."""

from __future__ import annotations

import select

from prefill_worker.transfer.sglang.control import Mailbox, Received
from prefill_worker.transfer.sglang.frames import AbortNotice, Endpoint, FrameError
from tests.unit.transfer.test_sglang_desk import registration


def is_readable(mailbox: Mailbox) -> bool:
    return bool(select.select([mailbox.fileno()], [], [], 0)[0])


def test_a_turn_takes_a_bounded_number_of_registrations() -> None:
    mailbox = Mailbox()
    try:
        reg, abort = registration(), AbortNotice(1, Endpoint("127.0.0.1", 9), None)
        for message in [reg, abort, reg, reg, FrameError("x"), reg, abort]:
            mailbox.put(Received(message, "127.0.0.1"))
        first = [r.message for r in mailbox.take(2)]
        assert first == [reg, abort, reg] and mailbox.has_items and is_readable(mailbox)
        second = [type(r.message) for r in mailbox.take(2)]
        assert second == [type(reg), FrameError, type(reg)] and is_readable(mailbox)
        assert [r.message for r in mailbox.take(2)] == [abort]
        assert not mailbox.has_items and not is_readable(mailbox)
    finally:
        mailbox.close()
