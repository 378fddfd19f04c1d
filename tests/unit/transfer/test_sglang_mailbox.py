"""The hand-over from the SGLang control thread to the engine: one turn takes at most a few
registrations (each costs NIXL work), other decodes' messages do not wait behind those left,
a decode's own messages never overtake its registration, waiting registrations are capped,
and the pipe stays readable while anything waits."""

from __future__ import annotations

import dataclasses
import select

from prefill_worker.transfer.sglang.control import Mailbox, Received
from prefill_worker.transfer.sglang.frames import AbortNotice, Endpoint, FrameError, Registration
from tests.unit.transfer.test_sglang_desk import registration


def is_readable(mailbox: Mailbox) -> bool:
    return bool(select.select([mailbox.fileno()], [], [], 0)[0])


def at(port: int) -> Registration:
    return dataclasses.replace(registration(), endpoint=Endpoint("127.0.0.1", port))


def abort(port: int) -> AbortNotice:
    return AbortNotice(1, Endpoint("127.0.0.1", port), None)


def test_a_turn_takes_a_few_registrations_and_holds_only_their_senders() -> None:
    mailbox = Mailbox()
    try:
        sent = [at(1), at(2), at(3), abort(3), abort(9), FrameError("x"), at(4), abort(1)]
        for message in sent:
            mailbox.put(Received(message, "127.0.0.1"))
        first = [r.message for r in mailbox.take(2)]
        assert first == [at(1), at(2), abort(9), sent[5], abort(1)]  # 3's abort waits for it
        assert mailbox.has_items and is_readable(mailbox)
        assert [r.message for r in mailbox.take(2)] == [at(3), abort(3), at(4)]
        assert not mailbox.has_items and not is_readable(mailbox)
    finally:
        mailbox.close()


def test_waiting_registrations_are_capped() -> None:
    mailbox = Mailbox(max_waiting_registrations=2)
    try:
        for port in (1, 2, 3):
            mailbox.put(Received(at(port), "127.0.0.1"))
        taken = [r.message for r in mailbox.take(8)]
        assert taken[:2] == [at(1), at(2)] and isinstance(taken[2], FrameError)
        assert "registration dropped: 2 are waiting" in str(taken[2])
        mailbox.put(Received(at(3), "127.0.0.1"))  # room again once taken
        assert [r.message for r in mailbox.take(8)] == [at(3)]
    finally:
        mailbox.close()
