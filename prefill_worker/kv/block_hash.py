"""Block hashes: a deterministic unsigned 64-bit id for each full KV page of a prompt.

A block is ``page_size`` consecutive prompt tokens starting at a multiple of ``page_size``.
Its hash is chained over the prompt, so equal hashes mean equal prefixes, not just equal
blocks::

    tokens   [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t47 ][ t48 t49 ]   (page_size 16)
    hash     h0           h1            h2            (partial: no hash)
             h0 = H(ROOT, block 0)   h1 = H(h0, block 1)   h2 = H(h1, block 2)

``H`` (BLAKE2b, 8-byte digest, personalised), why it does not depend on the process, and why
the cache still compares tokens on every hit (64 bits do not resist a crafted collision) are
in docs/prefix-cache.md ("The hash", "Collisions").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

PERSON = b"prefill-worker.1"  # BLAKE2b personalisation: a new scheme gets a new one
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def pack_block(token_ids: Sequence[int], start: int, page_size: int) -> bytes:
    """Tokens ``[start, start + page_size)`` as little-endian int32 bytes."""
    return np.asarray(token_ids[start : start + page_size], dtype="<i4").tobytes()


def block_hash(parent: int | None, packed_tokens: bytes) -> int:
    """The hash of one block given its parent's hash (None for a prompt's first block)."""
    digest = hashlib.blake2b(digest_size=8, person=PERSON)
    digest.update(_NO_PARENT if parent is None else _HAS_PARENT + parent.to_bytes(8, "little"))
    digest.update(packed_tokens)
    return int.from_bytes(digest.digest(), "little")


def block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """The hash of every full block of a prompt, in order (its partial last block has none)."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, pack_block(token_ids, start, page_size))
        hashes.append(parent)
    return hashes
