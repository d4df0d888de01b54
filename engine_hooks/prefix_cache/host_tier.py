"""The host tier of ``TieredPrefixCache``: its slots of the CTMs' host swap space, free or caching a
block (by hash, in LRU order: the oldest is given up first)."""
from __future__ import annotations

import collections
from typing import Iterable


class HostTier:
    def __init__(self, num_slots: int):
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # hash -> slot, oldest first

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._lru

    def slot_of(self, block_hash: str) -> int | None:
        return self._lru.get(block_hash)

    def hashes(self) -> list[str]:
        return list(self._lru)

    def touch(self, block_hash: str) -> None:
        """The cached block was used again: most recent."""
        self._lru.move_to_end(block_hash)

    def add(self, block_hash: str, slot: int) -> None:
        """Slot ``slot`` (taken from ``take_free`` or ``evict_oldest``) now holds the block."""
        self._lru[block_hash] = slot

    def take_free(self, n: int) -> list[int]:
        """Up to ``n`` free slots."""
        return [self._free.popleft() for _ in range(min(n, len(self._free)))]

    def evict_oldest(self, n: int) -> list[tuple[str, int]]:
        """Give up to ``n`` of the least recently used cached blocks: their (hash, slot)."""
        return [self._lru.popitem(last=False) for _ in range(min(n, len(self._lru)))]

    def hold(self, hashes: Iterable[str]) -> dict[str, int]:
        """Take cached blocks out of the LRU (a request is loading them), until ``put_back``."""
        return {h: self._lru.pop(h) for h in hashes}

    def put_back(self, held: dict[str, int]) -> None:
        """Held blocks are cached again, most recent."""
        self._lru.update(held)

    def free(self, slots: Iterable[int]) -> None:
        self._free.extend(slots)

    def clear(self) -> None:
        """Forget every cached block; their slots are free."""
        self._free.extend(self._lru.values())
        self._lru.clear()

    def free_count(self) -> int:
        return len(self._free)

    def cached_count(self) -> int:
        return len(self._lru)
