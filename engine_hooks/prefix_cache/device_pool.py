"""The device tier of ``TieredPrefixCache``: where every block of its device pool is.

A block is *free*, *pinned* (reference counted: by the requests that lease it and the storage
writes that read it), *cached* (mapped to its block hash; an unpinned cached block sits in the
LRU, from which allocation evicts), or, under write_back, an idle *bounce block*: kept apart to
write host blocks back through (``engine_hooks.prefix_cache.write_policy``).  Blocks the cache quarantines
for late tasks are simply in none of these until it gives them back with ``free``.
"""
from __future__ import annotations

import collections
from typing import Iterable


class DevicePool:
    def __init__(self, num_blocks: int, bounce_blocks: int):
        """The last ``bounce_blocks`` of the ``num_blocks`` are bounce blocks."""
        first_bounce = num_blocks - bounce_blocks
        self._free: collections.deque[int] = collections.deque(range(first_bounce))
        self._bounce_free = list(range(first_bounce, num_blocks))
        self._bounce_ids = frozenset(self._bounce_free)
        self._refs: collections.Counter = collections.Counter()
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unpinned
        self._by_hash: dict[str, int] = {}
        self._hash: dict[int, str] = {}

    # ------------------------------------------------------------------ pins
    def pin(self, block: int) -> None:
        """One more holder of ``block``; a cached block leaves the LRU while pinned."""
        self._refs[block] += 1
        self._lru.pop(block, None)

    def unpin(self, block: int) -> None:
        """One holder less; the last one puts a cached block in the LRU (most recent) and frees
        any other."""
        self._refs[block] -= 1
        if self._refs[block] <= 0:
            del self._refs[block]
            if block in self._hash:
                self._lru[block] = None
            else:
                self.free([block])

    def unpin_to_limbo(self, block: int) -> None:
        """Drop a pin without putting the block anywhere: the caller quarantines it."""
        self._refs[block] -= 1
        if self._refs[block] <= 0:
            del self._refs[block]

    def pinned(self, block: int) -> bool:
        return self._refs[block] > 0

    def pinned_blocks(self) -> list[int]:
        return [b for b, n in self._refs.items() if n > 0]

    # ------------------------------------------------------------------ free blocks
    def free(self, blocks: Iterable[int]) -> None:
        """Blocks nothing holds any more: back to their pool (bounce blocks to theirs)."""
        for block in blocks:
            (self._bounce_free if block in self._bounce_ids else self._free).append(block)

    def available(self) -> int:
        """Blocks an allocation can have: free, or cached and unpinned (evicted)."""
        return len(self._free) + len(self._lru)

    def take_free(self, n: int) -> list[int]:
        """Up to ``n`` free blocks (not bounce blocks)."""
        return [self._free.popleft() for _ in range(min(n, len(self._free)))]

    def cached_count(self) -> int:
        """Cached blocks no one pins: those eviction may take."""
        return len(self._lru)

    def evict_oldest(self, n: int) -> list[tuple[int, str]]:
        """Take the ``n`` least recently used unpinned cached blocks out of the cache: (block, hash)."""
        victims = [self._lru.popitem(last=False)[0] for _ in range(n)]
        out = [(block, self._hash.pop(block)) for block in victims]
        for _, h in out:
            del self._by_hash[h]
        return out

    # ------------------------------------------------------------------ bounce blocks
    def has_bounce_blocks(self) -> bool:
        return bool(self._bounce_ids)

    def bounce_free_count(self) -> int:
        return len(self._bounce_free)

    def take_bounce(self, n: int) -> list[int]:
        """Up to ``n`` idle bounce blocks."""
        return [self._bounce_free.pop() for _ in range(min(n, len(self._bounce_free)))]

    # ------------------------------------------------------------------ the hash map
    def block_of(self, block_hash: str) -> int | None:
        return self._by_hash.get(block_hash)

    def commit(self, block_hash: str, block: int) -> None:
        """``block`` holds ``block_hash``'s contents: make it findable, unless either is mapped already."""
        if block_hash not in self._by_hash and block not in self._hash:
            self._by_hash[block_hash] = block
            self._hash[block] = block_hash

    def forget_all(self) -> None:
        """Unmap every cached block; the unpinned ones are free."""
        self._free.extend(self._lru)
        self._lru.clear()
        self._by_hash.clear()
        self._hash.clear()

    def counts(self) -> dict[str, int]:
        return {"free": len(self._free), "cached": len(self._lru), "pinned": len(self._refs),
                "bounce": len(self._bounce_free)}
