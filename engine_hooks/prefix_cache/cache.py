"""TieredPrefixCache: the engine's prefix cache over device, host and storage tiers.

Blocks are identified by chained block hashes (``transfer_factory.keys``), so a hash seen
before means the whole prefix up to it was seen before.  Every byte moves through the CTM
service; this class only decides what moves.

* **Device tier**: a pool of ``num_device_blocks`` blocks.  A block in use by a request is
  pinned (reference counted); unpinned blocks keep their contents and sit in an LRU, from
  which allocation evicts (``engine_hooks.prefix_cache.device_pool``).
* **Host tier**: ``num_host_blocks`` slots of the CTMs' swap space, with its own LRU.  An
  evicted device block is swapped out to host while the host tier has slots (the host LRU
  gives up its oldest entry when full), otherwise dropped.
* **Storage tier**, by ``write_policy`` (``write_through``, ``write_through_selective``,
  ``write_back`` through kept-apart *bounce blocks*, or ``none``): a ``WritePolicy`` the cache holds
  (``engine_hooks.prefix_cache.write_policy``).
  A write keeps the blocks it reads pinned until it completes *and* is released, so no write reads
  a reused block or wrong bytes.

``acquire(hashes)`` walks the prefix: device hits are pinned in place; host hits are swapped
in; the rest is offered to storage, which loads the leading run it has into newly allocated
blocks.  Anything not loaded, or whose load failed, is a miss the caller must compute: a
failed load falls back to recompute, never to wrong data.  ``commit`` registers the request's
blocks, ``release`` submits the policy's writes and unpins them.

**Late tasks** (DESIGN §3.8, ``engine_hooks.core.late_tasks``).  Until a failed or timed-out task's
``future.released`` resolves, the device blocks and host slots it may still touch are *quarantined*:
not free, in no LRU, in no lease (a failed load's request gets fresh blocks to compute into; a failed
write's blocks simply stay pinned).  Released ones return on the next allocation, ``reap()`` or ``drain()``.

**Accounting from facts.**  ``TierStats`` counts what the ranks report: blocks from the futures'
results, bytes from each rank's ``RankResult.bytes_moved`` summed over ranks.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from transfer_factory.keys import salted_hashes

from ..core.late_tasks import Quarantine, bytes_moved, outcome
from ..kv_events import MEDIUM_CPU, KVEventPublisher
from .device_pool import DevicePool
from .host_tier import HostTier
from .storage_writes import StorageWrite, StorageWrites
from .tier_events import tier_events
from .tiers import TIERS, CapacityError, Lease, TierStats
from .write_policy import WRITE_POLICIES, WritePolicy, bounce_blocks_for, check_write_policy

if TYPE_CHECKING:
    from ..service import CacheTransferService

logger = logging.getLogger(__name__)

__all__ = ["TIERS", "WRITE_POLICIES", "CapacityError", "Lease", "TierStats", "TieredPrefixCache"]


class TieredPrefixCache:
    def __init__(self, service: "CacheTransferService", num_device_blocks: int, num_host_blocks: int, *,
                 write_policy: str = "write_through", write_threshold: int = 2, use_storage: bool = True,
                 task_timeout: float = 30.0, release_wait: float | None = None, bounce_blocks: int | None = None,
                 kv_events: KVEventPublisher | None = None):
        """``write_policy``: one of ``WRITE_POLICIES`` (see ``engine_hooks.prefix_cache.write_policy``);
        ``write_threshold``: the hits after which ``write_through_selective`` writes a block.
        ``release_wait``: how long an allocation that cannot be served waits for in-flight writes and
        late tasks to give blocks back before it raises ``CapacityError`` (default ``task_timeout + 10``,
        past the storage tasks' grace).  ``bounce_blocks``: device blocks of the pool kept apart to
        write host blocks back through (write_back with a host tier and storage only)."""
        check_write_policy(write_policy, write_threshold)
        if num_device_blocks < 1 or num_device_blocks > service.spec.num_blocks:
            raise ValueError(f"num_device_blocks {num_device_blocks} must be in 1..{service.spec.num_blocks}")
        if not 0 <= num_host_blocks <= service.num_cpu_blocks:
            raise ValueError(f"num_host_blocks {num_host_blocks} must be in 0..{service.num_cpu_blocks} "
                             "(the CTMs' swap space)")
        bounce_blocks = bounce_blocks_for(write_policy, num_device_blocks, num_host_blocks, use_storage, bounce_blocks)
        self.svc = service
        self.use_storage = use_storage
        self.task_timeout = task_timeout
        self.release_wait = task_timeout + 10.0 if release_wait is None else release_wait
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self._pool = DevicePool(num_device_blocks, bounce_blocks)
        self._host = HostTier(num_host_blocks)
        self._writes = StorageWrites()
        # KV events of the host and storage tiers (engine_hooks.kv_events), off without a publisher
        self._events = tier_events(kv_events, service.spec.block_size, self._pool, self._host, self._writes)
        self._quarantine = Quarantine()
        self.stats = TierStats()
        self._seen_restarts = getattr(service, "rank_replacements", 0)
        self._policy = WritePolicy(write_policy, write_threshold, service=service, pool=self._pool,
                                   writes=self._writes, stats=self.stats, task_timeout=task_timeout,
                                   use_storage=use_storage, release_wait=self.release_wait, hold=self._hold,
                                   wait_for=lambda until: self._settle(self.release_wait, until),
                                   events=self._events)

    @property
    def write_policy(self) -> str:
        return self._policy.policy

    @property
    def write_threshold(self) -> int:
        return self._policy.threshold

    @property
    def stored_hashes(self) -> frozenset[str]:
        """The block hashes this engine knows are in storage (read-only)."""
        return self._policy.stored_hashes()

    def pinned(self, block: int) -> bool:
        return self._pool.pinned(block)

    # ------------------------------------------------------------------ quarantine and reaping
    def _hold(self, future: Future, blocks: Iterable[int], slots: Iterable[int], what: str) -> None:
        """Keep ``blocks``/``slots`` of a failed or late task out of circulation until it is released.
        The caller has already taken them out of every free list, LRU and pin count."""
        blocks, slots = list(blocks), list(slots)
        if self._quarantine.hold(future, blocks, slots, what):
            self.stats.add(quarantined_blocks=len(blocks), quarantined_slots=len(slots))
        else:  # released already: nothing can touch them any more
            self._pool.free(blocks)
            self._host.free(slots)

    def reap(self) -> None:
        """Unpin the blocks of finished and released writes; give released quarantined blocks
        and slots back to the free lists.  Never waits."""
        blocks, slots = self._quarantine.reap()
        self._pool.free(blocks)
        self._host.free(slots)
        self._policy.reap_writes()

    def reap_writes(self, wait: bool = False) -> None:
        """``reap()``; with ``wait``, first wait (bounded by ``release_wait``) for every storage write
        to finish and be released."""
        if wait:
            self._settle(self.release_wait, lambda: not self._writes)
        self.reap()

    def _settle(self, timeout: float, until: Callable[[], bool]) -> bool:
        """Reap as writes finish and late tasks are released until ``until()`` or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            self.reap()
            if until():
                return True
            waiting = self._quarantine.pending() + self._writes.pending()
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                return until()
            concurrent.futures.wait(waiting, timeout=remaining, return_when=concurrent.futures.FIRST_COMPLETED)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait (at most ``timeout``) until every storage write is done and every late task released.
        False if something is still outstanding (it is logged)."""
        if self._settle(timeout, lambda: not self._writes and not self._quarantine):
            return True
        logger.warning("drain: after %.0fs, %d storage writes and %d late tasks still hold blocks", timeout,
                       len(self._writes), len(self._quarantine))
        return False

    # ------------------------------------------------------------------ allocation and eviction
    def _allocate(self, n: int, request_id: str | None = None) -> list[int]:
        self.reap()
        if n > self._pool.available():
            self._settle(self.release_wait, lambda: n <= self._pool.available())
        if n > self._pool.available():
            raise self._capacity_error(n)
        out: list[int] = []
        while True:
            out += self._pool.take_free(n - len(out))
            if len(out) == n:
                return out
            if self._pool.cached_count():
                got, writes = self._evict(min(n - len(out), self._pool.cached_count()), request_id)
                out += got
                # write_back: dropped blocks are usable once their writes are done and released; a
                # store that does not answer stops the allocation rather than evict the whole LRU
                if writes and not self._settle(self.release_wait,
                                               lambda: not self._writes.includes_any(writes)):
                    self._pool.free(out)
                    raise self._capacity_error(n, f"write-backs of {sum(len(w.blocks) for w in writes)} evicted "
                                                  f"blocks not released after {self.release_wait:.1f}s")
            elif not self._settle(self.release_wait, lambda: self._pool.available() > 0):
                self._pool.free(out)
                raise self._capacity_error(n)

    def _capacity_error(self, n: int, why: str = "") -> CapacityError:
        counts = self.block_counts()
        return CapacityError(
            f"needs {n} device blocks, {why or f'only {self._pool.available()} of {self.num_device_blocks} are unpinned'} "
            f"({counts['pinned']} pinned, {counts['writing']} of them by storage writes in flight; "
            f"{counts['quarantined']} quarantined until late tasks release them)")

    def _evict(self, n: int, request_id: str | None = None) -> tuple[list[int], list[StorageWrite]]:
        """Evict the ``n`` least recently used cached blocks, swapping them out to host if it has room
        (the host LRU gives up its oldest entries).  Returns the blocks usable now, and the write-backs
        that pin the others (write_back: a dropped block is written first)."""
        evicted = self._pool.evict_oldest(n)
        victims = [b for b, _ in evicted]
        to_host = []
        for block, h in evicted:
            if h in self._host:
                self._host.touch(h)
            else:
                to_host.append((block, h))
        slots = self._host_slots(len(to_host), request_id)  # a request's evictions are its tasks too
        out, dropped = to_host[:len(slots)], to_host[len(slots):]
        out_gpu = [b for b, _ in out]
        if out_gpu:
            future = self.svc.swap_to_cpu(out_gpu, slots, timeout=self.task_timeout, request_id=request_id)
            ok, _, exc = outcome(future, self.task_timeout + 10)
            self.stats.add(bytes_d2h=bytes_moved(future))
            if ok:
                for (_, h), slot in zip(out, slots):
                    self._host.add(h, slot)
                self._events.stored([h for _, h in out], MEDIUM_CPU)
                self.stats.add(swap_out_blocks=len(out_gpu))
            else:  # the blocks are dropped, not lost: storage or recompute has them
                logger.warning("swap-out of %d blocks failed (%s); dropping them", len(out_gpu),
                               exc or "a rank has not released it")
                # A late swap-out still writes these slots: quarantine them.  The device blocks it
                # reads keep their bytes (a write-back may read them too) and may be reused once
                # no write needs them: writing them can only spoil the slots' copies, which are
                # never mapped to a hash.
                self._hold(future, [], slots, f"swap-out to host slots {slots[:4]}")
                self.stats.add(dropped_blocks=len(out_gpu))
                dropped = out + dropped
        self.stats.add(dropped_blocks=len(victims) - len(out_gpu))
        return self._policy.leave_device(victims, dropped, request_id)

    def _host_slots(self, n: int, request_id: str | None = None) -> list[int]:
        """Up to ``n`` host slots: free ones, then those the host LRU gives up (oldest first)."""
        slots = self._host.take_free(n)
        evicted = self._host.evict_oldest(n - len(slots))
        self._events.removed((h for h, _ in evicted), MEDIUM_CPU)
        return slots + self._policy.leave_host(evicted, request_id) if evicted else slots

    # ------------------------------------------------------------------ requests
    def acquire(self, hashes: Sequence[str], cache_salt: str | None = None,
                request_id: str | None = None) -> Lease:
        """Find and load the request's cached prefix; every block of the lease is pinned.
        ``cache_salt``: the tenant's salt; the lease's hashes are the salted ones, so blocks of
        different salts never serve each other in any tier (``transfer_factory.keys.salted_hashes``)."""
        self._forget_host_tier_after_restarts()
        hashes = salted_hashes(hashes, cache_salt)
        self._events.note_lease(hashes, cache_salt)
        n = len(hashes)
        sources: list[str] = []
        gpu: list[int] = []
        host_pos: list[int] = []
        for h in hashes:  # the leading run cached on device or host
            block = self._pool.block_of(h)
            if block is not None:
                self._pool.pin(block)
                gpu.append(block)
                sources.append("device")
            elif h in self._host:
                host_pos.append(len(sources))
                gpu.append(-1)
                sources.append("host")
            else:
                break
        first_uncached = len(sources)
        # Hold the host hits out of the host LRU: evictions made to free device blocks for this
        # very request must not give their slots away.
        held = self._host.hold(hashes[i] for i in host_pos)
        try:
            fresh = self._allocate(len(host_pos) + n - first_uncached, request_id)
        except CapacityError:
            self._host.put_back(held)
            for i, s in enumerate(sources):
                if s == "device":
                    self._pool.unpin(gpu[i])
            raise
        for block in fresh:
            self._pool.pin(block)
        it = iter(fresh)
        for i in host_pos:
            gpu[i] = next(it)
        gpu += list(it)
        sources += ["miss"] * (n - first_uncached)
        lease = Lease(hashes, gpu, sources, cache_salt=cache_salt or None, request_id=request_id)
        try:
            load_from = self._swap_in(lease, host_pos, first_uncached, held)
            self._host.put_back(held)  # the host copies stay valid: back in the LRU, most recent
            held = {}
            if self.use_storage and load_from < n:
                self._read_storage(lease, load_from)
        except CapacityError:
            # No fresh blocks for what a failed load left quarantined: give the request up whole.
            self._host.put_back(held)
            for block in lease.gpu_blocks:
                if block >= 0:
                    self._pool.unpin(block)
            raise
        self._policy.count_hits(lease)
        return lease

    def _replace(self, lease: Lease, positions: list[int], future: Future, what: str) -> None:
        """A failed load may still write ``positions``' blocks: quarantine them and give the request
        fresh blocks to compute into.  Raises ``CapacityError`` (those positions then hold -1)."""
        old = [lease.gpu_blocks[i] for i in positions]
        for i, block in zip(positions, old):
            self._pool.unpin_to_limbo(block)  # fresh blocks of this lease: pinned once, by it alone
            lease.gpu_blocks[i] = -1
            lease.sources[i] = "miss"
        self._hold(future, old, [], what)
        fresh = self._allocate(len(old), lease.request_id)
        for i, block in zip(positions, fresh):
            self._pool.pin(block)
            lease.gpu_blocks[i] = block

    def _swap_in(self, lease: Lease, host_pos: list[int], first_uncached: int, held: dict[str, int]) -> int:
        """Swap the host hits in; returns where storage may take over (after a failure, nowhere)."""
        if not host_pos:
            return first_uncached
        slots = [held[lease.hashes[i]] for i in host_pos]
        future = self.svc.swap_to_gpu([lease.gpu_blocks[i] for i in host_pos], slots, timeout=self.task_timeout,
                                      request_id=lease.request_id)
        ok, _, exc = outcome(future, self.task_timeout + 10)
        self.stats.add(bytes_h2d=bytes_moved(future))
        if ok:
            self.stats.add(swap_in_blocks=len(host_pos))
            return first_uncached
        logger.warning("swap-in of %d blocks failed (%s): recomputing from block %d", len(host_pos),
                       exc or "a rank has not released it", host_pos[0])
        self.stats.add(failed_loads=len(host_pos))
        # A late swap-in still reads these slots and writes these blocks: neither the host copies
        # (a restarted rank's swap space is empty, too) nor the blocks may be used until it is released.
        for i in host_pos:
            del held[lease.hashes[i]]
        self._events.removed((lease.hashes[i] for i in host_pos), MEDIUM_CPU)
        for i in range(host_pos[0], len(lease.sources)):
            if lease.sources[i] == "host":
                lease.sources[i] = "miss"
        self._hold(future, [], slots, f"swap-in from host slots {slots[:4]}")
        self._replace(lease, host_pos, future, f"swap-in to device blocks {[lease.gpu_blocks[i] for i in host_pos][:4]}")
        return len(lease.sources)  # a hole in the prefix: nothing after it is worth loading

    def _read_storage(self, lease: Lease, start: int) -> None:
        gpu = lease.gpu_blocks[start:]
        future = self.svc.read_storage(lease.hashes, gpu, start_read_block_idx=start, timeout=self.task_timeout,
                                       request_id=lease.request_id)
        ok, loaded, exc = outcome(future, self.task_timeout + 15)
        self.stats.add(bytes_from_storage=bytes_moved(future))
        if not ok:
            logger.warning("storage read failed (%s): recomputing", exc or "a rank has not released it")
            self.stats.add(failed_loads=1)
            self._replace(lease, list(range(start, len(lease.sources))), future,
                          f"storage read into device blocks {gpu[:4]}")
            return
        if not isinstance(loaded, list) or loaded != gpu[:len(loaded)]:
            logger.error("storage returned blocks %s for %s; recomputing", str(loaded)[:40], gpu[:4])
            return
        for i in range(start, start + len(loaded)):
            lease.sources[i] = "storage"
        self._policy.read_result(lease.hashes[start:], len(loaded))  # found, and the first missing
        self.stats.add(storage_read_blocks=len(loaded))

    def commit(self, lease: Lease) -> None:
        """The request's blocks now hold their contents: make them findable."""
        for h, block in zip(lease.hashes, lease.gpu_blocks):
            self._pool.commit(h, block)

    def release(self, lease: Lease) -> None:
        """Submit the request's writes (write_through, write_through_selective) and unpin its blocks;
        the blocks a write reads stay pinned until it is done and released (a late write must never
        see the engine's next bytes in its blocks)."""
        if not self._policy.write_at_release(lease):
            for block in lease.gpu_blocks:
                self._pool.unpin(block)

    # ------------------------------------------------------------------ inspection
    def device_block_of(self, block_hash: str) -> int | None:
        return self._pool.block_of(block_hash)

    def host_slot_of(self, block_hash: str) -> int | None:
        return self._host.slot_of(block_hash)

    def quarantined(self) -> tuple[set[int], set[int]]:
        """(device blocks, host slots) held back for late tasks right now."""
        return self._quarantine.blocks(), self._quarantine.slots()

    def block_counts(self) -> dict[str, int]:
        """Where every device block is: free, cached (unpinned, in the LRU), pinned, quarantined, or an
        idle bounce block (write_back); they sum to ``num_device_blocks``.  ``writing``: the pinned
        blocks held by storage writes in flight."""
        return {**self._pool.counts(), "quarantined": len(self._quarantine.blocks()),
                "writing": len(self._writes.blocks()),
                "host_free": self._host.free_count(), "host_cached": self._host.cached_count(),
                "host_quarantined": len(self._quarantine.slots())}

    def forget_all(self, timeout: float = 60.0) -> None:
        """Forget every cached block, device and host (after ``svc.clear_caches()``: KV computed with
        the old weights must never be served again).  Nothing is written, under any policy.  Writes
        and late tasks are waited for first (bounded); a block a request still holds is an error."""
        self.drain(timeout)
        held = self._pool.pinned_blocks()
        if held:
            raise RuntimeError(f"forget_all: requests still hold device blocks {sorted(held)[:8]}")
        self._pool.forget_all()
        self._host.clear()
        self._policy.forget_all()  # the storage namespace changed with the weights
        self._events.cleared()

    def _forget_host_tier_after_restarts(self) -> None:
        """A rank restarted since the last request (the service does that by itself): its swap
        space is empty, so the host tier is forgotten here, on the engine's thread, rather than each
        of its blocks failing one swap-in and being recomputed."""
        restarts = getattr(self.svc, "rank_replacements", 0)
        if restarts != self._seen_restarts:
            self._seen_restarts = restarts
            if self._host.cached_count():
                logger.warning("a rank was restarted: forgetting the %d blocks of the host tier",
                               self._host.cached_count())
            self.drop_host_tier()

    def drop_host_tier(self) -> None:
        """Forget every host copy (after ``svc.restart_rank``: the new rank's swap space is empty;
        under write_back, what only the host held is lost, never written)."""
        self._events.removed(self._host.hashes(), MEDIUM_CPU)
        for h in self._host.hashes():
            if self._pool.block_of(h) is None:
                self._policy.forget(h)
        self._host.clear()
