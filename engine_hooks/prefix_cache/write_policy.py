"""Write policies of ``TieredPrefixCache``: which blocks go to storage, and when.

* ``write_through``: every block of a request is written at its end (blocks already stored are
  skipped by the ranks).
* ``write_through_selective``: at a request's end, only its blocks hit at least ``write_threshold``
  times while cached (a hit on device or host alike; a storage hit is stored already), and not
  stored yet; each is written once (a write that stored nothing may be retried at a later hit).
  A block's count lives while it is cached on device or host, and is forgotten when it leaves
  both or is stored.
* ``write_back``: a block is written only when it leaves the last tier above storage, and only
  if storage does not hold it yet:

  - *dropped from device* (evicted with no host slot for it: host tier disabled, its slots
    quarantined, or its swap-out failed): written from its own device block, which stays
    pinned by the write; the allocation that evicted it waits (bounded) for the write to be done
    and released before it takes the block;
  - *evicted from host* (the host LRU gives up its oldest entry for a newer one): storage writes
    read device blocks, so the slot is first swapped into a **bounce block**, a device block kept
    apart for this (``bounce_blocks``, by default 1/32 of the pool, 1 to 32 blocks, only under
    write_back with a host tier and storage).  The write is submitted only once that swap-in has
    succeeded on every rank and is released, so it can only read the slot's bytes; the slot is
    reused only then too.  The bounce block stays pinned until the write is done and released,
    then serves the next one (an eviction with none free waits, bounded, for one).  A failed
    swap-in loses the block (never written: it is recomputed when needed) and quarantines the
    bounce block and the slot like any late task.  A host copy whose block is also cached on
    device is not written: the block has not left the cache.

  Why bounce blocks: writing a block when it leaves device for host would write blocks that are
  still cached (not write-back), and borrowing the evicting allocation's own blocks cannot work
  when the host is full of unwritten blocks (each would need one more).  A few blocks kept apart
  never deadlock and keep the writes asynchronous.  ``drop_host_tier`` (a restarted rank: its
  swap space is empty) loses what only the host held.

Every write keeps the device blocks it reads pinned until its future is done *and* released
(``storage_writes``, reaped by ``reap_writes``); counts come from the futures' results and bytes from the
ranks' ``RankResult.bytes_moved``, as for any task.

``WritePolicy`` is a component the cache holds: it owns what this engine knows storage holds and the
hit counts, and reaches the device pool, the writes in flight and the counters through their methods.
What belongs to the cache (quarantining a late task's blocks, waiting for blocks to come back) it is
handed as two callables.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

from ..core.late_tasks import bytes_moved, outcome
from ..kv_events.wire import MEDIUM_STORAGE
from .device_pool import DevicePool
from .storage_writes import StorageWrite, StorageWrites
from .tier_events import NO_EVENTS, NoTierEvents
from .tiers import Lease, TierStats

if TYPE_CHECKING:
    from ..service import CacheTransferService

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective", "none")
MAX_BOUNCE_BLOCKS = 32
# hold(future, device blocks, host slots, what): keep them out of circulation until the task is released
Hold = Callable[[Future, list[int], list[int], str], None]
# wait_for(until): reap writes and late tasks as they finish until until() (bounded); its last value
WaitFor = Callable[[Callable[[], bool]], bool]

def check_write_policy(write_policy: object, write_threshold: object) -> None:
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy {write_policy!r} must be one of {WRITE_POLICIES}")
    if not isinstance(write_threshold, int) or isinstance(write_threshold, bool) or write_threshold < 1:
        raise ValueError(f"write_threshold {write_threshold!r} must be a positive integer")


def default_bounce_blocks(write_policy: str, num_device_blocks: int, num_host_blocks: int,
                          use_storage: bool = True) -> int:
    """Device blocks a cache keeps apart to write host blocks back through (0 unless write_back
    with a host tier and storage)."""
    if write_policy != "write_back" or not num_host_blocks or not use_storage:
        return 0
    return max(1, min(MAX_BOUNCE_BLOCKS, num_device_blocks // 32))


def bounce_blocks_for(write_policy: str, num_device_blocks: int, num_host_blocks: int, use_storage: bool,
                      requested: int | None) -> int:
    """The bounce blocks a cache keeps: ``requested`` (default ``default_bounce_blocks``) where
    write_back needs them, else 0."""
    default = default_bounce_blocks(write_policy, num_device_blocks, num_host_blocks, use_storage)
    n = default if requested is None or not default else requested
    if default and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < num_device_blocks):
        raise ValueError(f"bounce_blocks {n!r} must be in 1..{num_device_blocks - 1} under write_back with a host "
                         "tier (the rest of the device pool caches)")
    return n


class WritePolicy:
    """Which blocks go to storage, and when (see the module doc)."""

    def __init__(self, policy: str, threshold: int, *, service: "CacheTransferService", pool: DevicePool,
                 writes: StorageWrites, stats: TierStats, task_timeout: float, use_storage: bool,
                 release_wait: float, hold: Hold, wait_for: WaitFor, events: NoTierEvents = NO_EVENTS):
        check_write_policy(policy, threshold)
        self.policy = policy
        self.threshold = threshold
        self._svc = service
        self._pool = pool
        self._writes = writes
        self._stats = stats
        self._task_timeout = task_timeout
        self._use_storage = use_storage
        self._release_wait = release_wait  # what wait_for is bounded by, for the log
        self._hold = hold
        self._wait_for = wait_for
        self._events = events  # STORAGE events: what this engine learns storage holds, or no longer does
        self._stored: set[str] = set()  # hashes this engine knows are in storage
        self._hits: dict[str, int] = {}  # write_through_selective: hits while cached

    # ------------------------------------------------------------------ what storage holds
    def stored_hashes(self) -> frozenset[str]:
        """The block hashes this engine knows are in storage."""
        return frozenset(self._stored)

    def mark_stored(self, hashes: list[str]) -> None:
        """A storage read found ``hashes``."""
        self._events.stored([h for h in hashes if h not in self._stored], MEDIUM_STORAGE)
        self._stored.update(hashes)

    def read_result(self, hashes: list[str], found: int) -> None:
        """A storage read of ``hashes`` (from the first it was asked for) found the leading ``found``; the
        next one is not in storage (an object evicted or spoiled there): forget it, so it is written again."""
        self.mark_stored(hashes[:found])
        missing = hashes[found:found + 1]
        if missing and missing[0] in self._stored:
            self._stored.discard(missing[0])
            self._events.removed(missing, MEDIUM_STORAGE)

    def forget(self, block_hash: str) -> None:
        """The block left device and host."""
        self._hits.pop(block_hash, None)

    def forget_all(self) -> None:
        """The storage namespace changed with the weights: nothing known is true any more."""
        self._stored.clear()
        self._hits.clear()

    def _unstored(self, block_hash: str) -> bool:
        return self._use_storage and block_hash not in self._stored

    # ------------------------------------------------------------------ writes
    def _submit_write(self, hashes: list[str], blocks: list[int], request_id: str | None = None) -> StorageWrite:
        """Write ``blocks`` under ``hashes``; the caller has pinned them for the write.  ``request_id``:
        the request it is written for (or whose allocation evicted them), recorded with the task."""
        future = self._svc.write_storage(hashes, blocks, timeout=self._task_timeout, request_id=request_id)
        return self._writes.add(future, blocks, hashes)

    def reap_writes(self) -> None:
        """Account the writes that are done and released, and unpin their blocks.  Never waits."""
        for w in self._writes.take_over():
            self._finish_write(w)

    def _finish_write(self, w: StorageWrite) -> None:
        """Account a write that is done and released (from its result), and unpin its blocks."""
        self._stats.add(bytes_to_storage=bytes_moved(w.future))
        try:
            stored = w.future.result(0)
            if not isinstance(stored, list):
                raise TypeError(f"write resolved to {type(stored).__name__}, expected the stored block ids")
            now_stored = w.hashes[:len(stored)]
            self._stats.add(storage_write_blocks=sum(h not in self._stored for h in now_stored))
            self._events.stored([h for h in now_stored if h not in self._stored], MEDIUM_STORAGE)
            self._stored.update(now_stored)
            for h in now_stored:
                self.forget(h)
        except Exception as exc:
            logger.warning("storage write of %d blocks failed: %s", len(w.blocks), exc)
        for block in w.blocks:
            self._pool.unpin(block)

    def count_hits(self, lease: Lease) -> None:
        if self.policy == "write_through_selective":
            for h, source in zip(lease.hashes, lease.sources):
                if source != "miss" and h not in self._stored:
                    self._hits[h] = self._hits.get(h, 0) + 1

    # ------------------------------------------------------------------ at a request's end
    def write_at_release(self, lease: Lease) -> bool:
        """Submit the request's writes; True when every block of the lease went to a write (the
        caller unpins the rest)."""
        if not self._use_storage or not lease.hashes:
            return False
        if self.policy == "write_through":
            if any(h not in self._stored for h in lease.hashes):
                self._submit_write(list(lease.hashes), list(lease.gpu_blocks), lease.request_id)
                return True
        elif self.policy == "write_through_selective":
            writing = self._writes.hashes()
            pos = [i for i, (h, b) in enumerate(zip(lease.hashes, lease.gpu_blocks))
                   if self._hits.get(h, 0) >= self.threshold and h not in self._stored
                   and h not in writing and self._pool.block_of(h) == b]  # committed: the request's bytes
            if pos:
                self._submit_write([lease.hashes[i] for i in pos], [lease.gpu_blocks[i] for i in pos], lease.request_id)
                held = set(pos)
                for i, block in enumerate(lease.gpu_blocks):
                    if i not in held:
                        self._pool.unpin(block)
                return True
        return False

    # ------------------------------------------------------------------ write_back
    def leave_device(self, victims: list[int], dropped: list[tuple[int, str]],
                     request_id: str | None = None) -> tuple[list[int], list[StorageWrite]]:
        """``dropped`` (block, hash) left device without reaching host.  Returns the victims usable
        now and the write-backs that pin the others."""
        for _, h in dropped:
            self.forget(h)
        if self.policy != "write_back":
            return victims, []
        dirty = [(b, h) for b, h in dropped if self._unstored(h)]
        if not dirty:
            return victims, []
        blocks = [b for b, _ in dirty]
        for block in blocks:
            self._pool.pin(block)
        w = self._submit_write([h for _, h in dirty], blocks, request_id)
        held = set(blocks)
        return [b for b in victims if b not in held], [w]

    def leave_host(self, evicted: list[tuple[str, int]], request_id: str | None = None) -> list[int]:
        """The host LRU gave up ``evicted`` (hash, slot): write back those only it held, through
        bounce blocks.  Returns the slots free to reuse now."""
        usable, dirty = [], []
        for h, slot in evicted:
            if self._pool.block_of(h) is not None:  # still cached on device
                usable.append(slot)
                continue
            self.forget(h)
            if self.policy == "write_back" and self._pool.has_bounce_blocks() and self._unstored(h):
                dirty.append((h, slot))
            else:
                usable.append(slot)
        while dirty:
            if not self._pool.bounce_free_count():
                self._wait_for(lambda: self._pool.bounce_free_count() > 0)
            if not self._pool.bounce_free_count():
                logger.warning("write-back: no bounce block came free in %.0fs; %d host blocks dropped unwritten",
                               self._release_wait, len(dirty))
                self._stats.add(dropped_blocks=len(dirty))
                usable += [s for _, s in dirty]
                break
            bounce = self._pool.take_bounce(len(dirty))
            group, dirty = dirty[:len(bounce)], dirty[len(bounce):]
            usable += self._write_back_slots([h for h, _ in group], [s for _, s in group], bounce, request_id)
        return usable

    def _write_back_slots(self, hashes: list[str], slots: list[int], bounce: list[int],
                          request_id: str | None = None) -> list[int]:
        """Swap ``slots`` into ``bounce`` blocks, then write them from there.  Returns the slots
        reusable now (none if the swap-in failed: they and the bounce blocks wait for its release)."""
        future = self._svc.swap_to_gpu(bounce, slots, timeout=self._task_timeout, request_id=request_id)
        ok, _, exc = outcome(future, self._task_timeout + 10)
        self._stats.add(bytes_h2d=bytes_moved(future))
        if not ok:
            logger.warning("write-back: swap-in of %d host blocks failed (%s); they are dropped unwritten",
                           len(slots), exc or "a rank has not released it")
            self._stats.add(dropped_blocks=len(slots))
            self._hold(future, bounce, slots, f"write-back swap-in from host slots {slots[:4]}")
            return []
        self._stats.add(swap_in_blocks=len(slots))
        for block in bounce:
            self._pool.pin(block)
        self._submit_write(hashes, bounce, request_id)
        return slots
