"""What the prefix cache tells the outside world about its blocks (the KV-event seam).

The prefix cache (kv/) calls a ``CacheEventSink`` whenever full pages enter or leave it; a
publisher at the edge (ZMQ PUB, in the format cache-aware routers consume) implements the
sink. The cache never imports the publisher: the daemon hands it a sink, ``NullCacheEvents``
when events are off.

A block is one full KV page (``block_size`` = the pool's page size). ``block_hash`` is a
deterministic unsigned 64-bit int chained over the prompt (``parent_block_hash`` is the hash
of the block before it in the same prompt, None for a prompt's first block); the cache owns
how it is computed, the sink only carries it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class CacheEventSink(Protocol):
    """Receives block events on the engine thread; must not block (queue, then return)."""

    def blocks_stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """Consecutive full blocks of one prompt entered the cache.

        ``token_ids`` holds ``len(block_hashes) * block_size`` ids, block after block;
        ``parent_block_hash`` precedes ``block_hashes[0]`` in the chain.
        """

    def blocks_removed(self, block_hashes: Sequence[int]) -> None:
        """These blocks were evicted and no longer hit."""

    def all_cleared(self) -> None:
        """Every cached block is gone (cache reset or shutdown)."""


class NullCacheEvents:
    """The sink when KV events are off."""

    def blocks_stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        return None

    def blocks_removed(self, block_hashes: Sequence[int]) -> None:
        return None

    def all_cleared(self) -> None:
        return None
