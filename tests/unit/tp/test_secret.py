"""``tp.secret``: where a group's secret comes from, and the proof every rank gives of it over
a real gloo group of two processes (a rank with another secret is named, on the rank that
holds the right one)."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from pathlib import Path

import pytest

from prefill_worker.testing.launch import free_port
from prefill_worker.tp.secret import (
    SECRET_BYTES,
    GroupAuthError,
    group_secret,
    prove_membership,
    read_secret_file,
)
from tests.patience import patient


def test_a_group_serve_starts_makes_a_new_secret_each_start() -> None:
    first, second = (group_secret(False, False, None) for _ in range(2))
    assert len(first) == SECRET_BYTES and first != second


def test_a_torchrun_group_reads_its_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123\n")
    assert group_secret(True, True, str(path)) == b"0123456789abcdef0123"


def test_a_torchrun_group_across_hosts_needs_a_file() -> None:
    with pytest.raises(ValueError, match=r"needs parallel\.group_secret_file"):
        group_secret(True, True, None)
    assert group_secret(True, False, None) == b""  # one host: nothing to prove


@pytest.mark.parametrize(("content", "says"), [(b"short\n", "holds 5 bytes"), (None, "No such")])
def test_a_bad_secret_file_is_refused(tmp_path: Path, content: bytes | None, says: str) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=says):
        read_secret_file(str(path))


def _rank(rank: int, port: int, secret: bytes, results: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    size = _SIZE
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        prove_membership(secret, rank, size)
        results.put((rank, "ok"))
    except GroupAuthError as exc:
        results.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


_SIZE = 3


def test_the_ranks_that_hold_the_secret_name_the_one_that_does_not() -> None:
    """Ranks 0 and 1 hold the secret, rank 2 another: 0 and 1 each name rank 2 alone (so each
    checked the other and found it right); rank 2, checking with its own, trusts nobody."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch.distributed", "prefill_worker.tp.secret"])
    results: multiprocessing.Queue = context.Queue()
    port = free_port()
    secrets = (b"s" * 32, b"s" * 32, b"x" * 32)
    ranks = [
        context.Process(target=_rank, args=(r, port, secrets[r], results)) for r in range(_SIZE)
    ]
    for process in ranks:
        process.start()
    try:
        verdicts = dict(results.get(timeout=patient(60)) for _ in ranks)
    finally:
        for process in ranks:
            process.join(patient(10))
            if process.is_alive():
                process.kill()
    for rank in (0, 1):
        assert "rank(s) 2 of the group do not hold its secret" in verdicts[rank]
    assert "rank(s) 0, 1 of the group" in verdicts[2]
