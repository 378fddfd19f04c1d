"""The group's shared secret: every rank proves it holds it before the group does any work.

torch's rendezvous store has no authentication, so whoever reaches it can join a group as a
rank (and would then be sent every step's plan and take part in every collective). Once the
process groups exist, ``prove_membership`` runs a challenge over the gloo group: each rank
contributes a fresh random nonce, every rank sends ``HMAC-SHA256(secret, all nonces ||
rank)``, and each checks every other's; a rank without the secret cannot answer (the nonces
are new each time, so an old answer is no use), and the group fails to start, naming it.

Where the secret comes from (``group_secret``): a group ``serve`` starts makes a new one each
start and hands it to its ranks on their stdin with the configuration; a torchrun group reads
``parallel.group_secret_file`` (the same file on every host), required when the group spans
hosts (a ``MASTER_ADDR`` off loopback), optional on one host.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
_NONCE_BYTES = 32


class GroupAuthError(ValueError):
    """A rank of the group does not hold its secret (a configuration error: exit 78)."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def read_secret_file(path: str) -> bytes:
    """The file's bytes, surrounding whitespace stripped; at least 16 of them."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"parallel.group_secret_file {path!r}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"parallel.group_secret_file {path!r} holds {len(secret)} bytes; a secret needs "
            f"at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def group_secret(is_torchrun: bool, spans_hosts: bool, secret_file: str | None) -> bytes:
    """This rank's secret for a group ``serve`` starts (a new one: its followers are handed
    it) or for a torchrun group (``secret_file``); ``ValueError`` for a group across hosts
    without one. A torchrun group on one host without a file proves nothing: ``b""``."""
    if not is_torchrun:
        return new_secret()
    if secret_file is not None:
        return read_secret_file(secret_file)
    if spans_hosts:
        raise ValueError(
            "a torchrun group across hosts needs parallel.group_secret_file (the same secret "
            "on every host): its rendezvous store lets anyone who reaches it join as a rank"
        )
    return b""


def _mac(secret: bytes, transcript: bytes, rank: int) -> bytes:
    return hmac.new(secret, transcript + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def _all_gather(data: bytes, size: int, group: Any) -> list[bytes]:
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t.numpy().tobytes()) for t in out]


def prove_membership(secret: bytes, rank: int, size: int, group: Any = None) -> None:
    """Every rank of ``group`` (a gloo group of ``size``) holds ``secret``, or
    ``GroupAuthError`` names the ranks that do not (on every rank that holds it). Nothing to
    prove with an empty secret (a torchrun group on one host without a file)."""
    if not secret:
        return
    transcript = b"".join(_all_gather(secrets.token_bytes(_NONCE_BYTES), size, group))
    macs = _all_gather(_mac(secret, transcript, rank), size, group)
    wrong = [
        r for r in range(size) if not hmac.compare_digest(macs[r], _mac(secret, transcript, r))
    ]
    if wrong:
        raise GroupAuthError(
            f"rank(s) {', '.join(map(str, wrong))} of the group do not hold its secret "
            "(parallel.group_secret_file differs, or a process that is no rank of this worker "
            "joined the rendezvous)"
        )
