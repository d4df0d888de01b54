"""What ``TieredPrefixCache`` tells a KV event publisher (``engine_hooks.kv_events``) about its host
(``medium`` CPU) and storage (``medium`` STORAGE) tiers.  The cache calls it only once a task's future
says every rank did it, so an event means "stored on every rank"; a block that leaves a tier anywhere
is removed there.

* ``BlockStored`` CPU: a swap-out to the host tier succeeded; STORAGE: a write's result, or a read,
  says storage holds the block.  One event per chain run of the blocks (``parent_block_hash`` the
  parent of its first block), ``block_size`` the KV block size in tokens, ``token_ids`` empty (the
  cache is given block hashes, never tokens), ``extra_keys`` the tenant's salt tag per block
  (``transfer_factory.keys.salt_tag``: a digest, never the salt) when a block has one.
* ``BlockRemoved`` CPU: the host LRU gave the block up, a failed swap-in emptied its slot, or the host
  tier was dropped; STORAGE: a read did not find a block this engine believed stored.
* ``AllBlocksCleared``: the cache started (a router forgets what an earlier process of this engine
  said) and on ``forget_all`` (an RL clear).

Hashes are the salted ones the cache keys blocks by.  Each event is published as its own batch, from
the engine's thread, without waiting.  ``NO_EVENTS`` (no publisher) does nothing at all.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Sequence

from transfer_factory.keys import salt_tag

from ..kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, wire_hash

if TYPE_CHECKING:
    from ..kv_events import KVEventPublisher
    from .device_pool import DevicePool
    from .host_tier import HostTier
    from .storage_writes import StorageWrites

logger = logging.getLogger(__name__)
_SWEEP_MIN = 4096


def _wire(block_hash: str) -> bytes:
    """A block hash on the wire: the bytes of our hex digest; any other string as its UTF-8 bytes."""
    try:
        return wire_hash(block_hash)
    except ValueError:
        return block_hash.encode()


class NoTierEvents:
    """KV events off: every hook is a no-op."""

    def note_lease(self, hashes: Sequence[str], cache_salt: str | None) -> None:
        pass

    def stored(self, hashes: Iterable[str], medium: str) -> None:
        pass

    def removed(self, hashes: Iterable[str], medium: str) -> None:
        pass

    def cleared(self) -> None:
        pass


NO_EVENTS = NoTierEvents()


class TierEvents(NoTierEvents):
    def __init__(self, publisher: "KVEventPublisher", block_size: int, pool: "DevicePool", host: "HostTier",
                 writes: "StorageWrites"):
        self._pub = publisher
        self._block_size = block_size
        self._pool, self._host, self._writes = pool, host, writes  # read to forget dead hashes' metadata
        self._meta: dict[str, tuple[str | None, str]] = {}  # hash -> (parent hash, salt tag)
        self._sweep_at = _SWEEP_MIN
        self._failed = False

    def note_lease(self, hashes: Sequence[str], cache_salt: str | None) -> None:
        """A request's (salted) chain: each block's parent and salt tag, for the events to come."""
        tag = salt_tag(cache_salt)
        for i, h in enumerate(hashes):
            self._meta[h] = (hashes[i - 1] if i else None, tag)
        if len(self._meta) > self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Forget the metadata of blocks in no tier above storage and in no write in flight (a STORAGE
        event for them can only come after a new lease notes them again)."""
        writing = self._writes.hashes()
        self._meta = {h: m for h, m in self._meta.items()
                      if self._pool.block_of(h) is not None or h in self._host or h in writing}
        self._sweep_at = max(_SWEEP_MIN, 2 * len(self._meta))

    def stored(self, hashes: Iterable[str], medium: str) -> None:
        runs: list[list[str]] = []
        for h in hashes:
            if runs and self._meta.get(h, (None, ""))[0] == runs[-1][-1]:
                runs[-1].append(h)
            else:
                runs.append([h])
        if not runs:
            return
        events = []
        for run in runs:
            parent, _ = self._meta.get(run[0], (None, ""))
            tags = [self._meta.get(h, (None, ""))[1] for h in run]
            events.append(BlockStored([_wire(h) for h in run], None if parent is None else _wire(parent),
                                      [], self._block_size, None, medium, None,
                                      [(t,) if t else None for t in tags] if any(tags) else None))
        self._publish(events)

    def removed(self, hashes: Iterable[str], medium: str) -> None:
        hashes = list(hashes)
        if hashes:
            self._publish([BlockRemoved([_wire(h) for h in hashes], medium)])

    def cleared(self) -> None:
        self._publish([AllBlocksCleared()])

    def _publish(self, events: list) -> None:
        try:
            self._pub.publish(events)
        except RuntimeError as exc:  # a closed publisher: the engine goes on, its events are lost
            if not self._failed:
                logger.warning("KV events not published (%s); subscribers will see the stream stop", exc)
            self._failed = True


def tier_events(publisher: "KVEventPublisher | None", block_size: int, pool: "DevicePool", host: "HostTier",
                writes: "StorageWrites") -> NoTierEvents:
    """The cache's events: ``NO_EVENTS`` without a publisher; else a ``TierEvents`` that has told
    subscribers this engine's tiers start empty."""
    if publisher is None:
        return NO_EVENTS
    events = TierEvents(publisher, block_size, pool, host, writes)
    events.cleared()
    return events
