"""TieredPrefixCache: the engine's prefix cache over device, host and storage tiers.

Blocks are identified by chained block hashes (``transfer_factory.keys``), so a hash seen
before means the whole prefix up to it was seen before.  Every byte moves through the CTM
service; this class only decides what moves.

* **Device tier**: a pool of ``num_device_blocks`` blocks.  A block in use by a request is
  pinned (reference counted); unpinned blocks keep their contents and sit in an LRU, from
  which allocation evicts.
* **Host tier**: ``num_host_blocks`` slots of the CTMs' swap space, with its own LRU.  An
  evicted device block is swapped out to host while the host tier has slots (the host LRU
  gives up its oldest entry when full), otherwise dropped.
* **Storage tier**: write-through at request end (``write_policy="write_through"``; ``"none"``
  writes nothing); a write keeps its blocks pinned until it completes.

``acquire(hashes)`` walks the prefix: device hits are pinned in place; host hits are swapped
in; the rest is offered to storage, which loads the leading run it has into newly allocated
blocks.  Anything not loaded, or whose load failed, is a miss the caller must compute: a
failed load falls back to recompute, never to wrong data.  ``commit`` registers the request's
blocks, ``release`` writes them through and unpins them.
"""
from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "storage", "miss")
WRITE_POLICIES = ("write_through", "none")


class CapacityError(ValueError):
    """A request needs more device blocks than the pool can ever free for it."""


@dataclass
class Lease:
    """One request's blocks: the device block and where its contents came from, per position."""

    hashes: list[str]
    gpu_blocks: list[int]
    sources: list[str]

    def positions(self, tier: str) -> list[int]:
        return [i for i, s in enumerate(self.sources) if s == tier]


@dataclass
class TierStats:
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    storage_write_blocks: int = 0
    storage_read_blocks: int = 0
    failed_loads: int = 0
    dropped_blocks: int = 0


class TieredPrefixCache:
    def __init__(self, service, num_device_blocks: int, num_host_blocks: int, *,
                 write_policy: str = "write_through", use_storage: bool = True, task_timeout: float = 30.0):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {write_policy!r} must be one of {WRITE_POLICIES}")
        if num_device_blocks < 1 or num_device_blocks > service.spec.num_blocks:
            raise ValueError(f"num_device_blocks {num_device_blocks} must be in 1..{service.spec.num_blocks}")
        if not 0 <= num_host_blocks <= service.num_cpu_blocks:
            raise ValueError(f"num_host_blocks {num_host_blocks} must be in 0..{service.num_cpu_blocks} "
                             "(the CTMs' swap space)")
        self.svc = service
        self.write_policy = write_policy
        self.use_storage = use_storage
        self.task_timeout = task_timeout
        self.num_device_blocks = num_device_blocks
        self._dev_free: collections.deque[int] = collections.deque(range(num_device_blocks))
        self._dev_by_hash: dict[str, int] = {}
        self._dev_hash: dict[int, str] = {}
        self._refs: collections.Counter = collections.Counter()
        self._dev_lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unpinned
        self._host_free: collections.deque[int] = collections.deque(range(num_host_blocks))
        self._host: collections.OrderedDict[str, int] = collections.OrderedDict()  # hash -> slot, LRU order
        self._stored: set[str] = set()  # hashes this engine knows are in storage
        self._writes: list[tuple[Future, list[int], list[str]]] = []
        self.stats = TierStats()

    # ------------------------------------------------------------------ pins
    def _pin(self, block: int) -> None:
        self._refs[block] += 1
        self._dev_lru.pop(block, None)

    def _unpin(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] <= 0:
            del self._refs[block]
            if block in self._dev_hash:
                self._dev_lru[block] = None  # cached: most recently used at the end
            else:
                self._dev_free.append(block)

    def pinned(self, block: int) -> bool:
        return self._refs[block] > 0

    # ------------------------------------------------------------------ allocation and eviction
    def _allocate(self, n: int) -> list[int]:
        self.reap_writes()
        if n > len(self._dev_free) + len(self._dev_lru):
            self.reap_writes(wait=True)
        available = len(self._dev_free) + len(self._dev_lru)
        if n > available:
            raise CapacityError(f"needs {n} device blocks, only {available} of {self.num_device_blocks} are unpinned")
        out = [self._dev_free.popleft() for _ in range(min(n, len(self._dev_free)))]
        if len(out) < n:
            out += self._evict(n - len(out))
        return out

    def _evict(self, n: int) -> list[int]:
        """Free the ``n`` least recently used cached blocks, swapping them out to host if it has room."""
        victims = [self._dev_lru.popitem(last=False)[0] for _ in range(n)]
        hashes = [self._dev_hash.pop(b) for b in victims]
        for h in hashes:
            del self._dev_by_hash[h]
        out_gpu, out_cpu, out_hash = [], [], []
        if self._host_free or self._host:
            for block, h in zip(victims, hashes):
                if h in self._host:
                    self._host.move_to_end(h)
                    continue
                slot = self._host_slot()
                if slot is None:
                    break
                out_gpu.append(block)
                out_cpu.append(slot)
                out_hash.append(h)
        if out_gpu:
            try:
                self.svc.swap_to_cpu(out_gpu, out_cpu, timeout=self.task_timeout).result(self.task_timeout + 10)
                for h, slot in zip(out_hash, out_cpu):
                    self._host[h] = slot
                self.stats.swap_out_blocks += len(out_gpu)
            except Exception as exc:  # the blocks are dropped, not lost: storage or recompute has them
                logger.warning("swap-out of %d blocks failed (%s); dropping them", len(out_gpu), exc)
                self._host_free.extend(out_cpu)
                self.stats.dropped_blocks += len(out_gpu)
        self.stats.dropped_blocks += len(victims) - len(out_gpu)
        return victims

    def _host_slot(self) -> int | None:
        if self._host_free:
            return self._host_free.popleft()
        if self._host:
            return self._host.popitem(last=False)[1]  # the host LRU gives up its oldest entry
        return None

    # ------------------------------------------------------------------ requests
    def acquire(self, hashes: Sequence[str]) -> Lease:
        """Find and load the request's cached prefix; every block of the lease is pinned."""
        hashes = list(hashes)
        n = len(hashes)
        sources: list[str] = []
        gpu: list[int] = []
        host_pos: list[int] = []
        for h in hashes:  # the leading run cached on device or host
            block = self._dev_by_hash.get(h)
            if block is not None:
                self._pin(block)
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
        held = {hashes[i]: self._host.pop(hashes[i]) for i in host_pos}
        try:
            fresh = self._allocate(len(host_pos) + n - first_uncached)
        except CapacityError:
            self._host.update(held)
            for i, s in enumerate(sources):
                if s == "device":
                    self._unpin(gpu[i])
            raise
        for block in fresh:
            self._refs[block] += 1
        it = iter(fresh)
        for i in host_pos:
            gpu[i] = next(it)
        gpu += list(it)
        sources += ["miss"] * (n - first_uncached)
        lease = Lease(hashes, gpu, sources)
        load_from = self._swap_in(lease, host_pos, first_uncached, held)
        self._host.update(held)  # the host copies stay valid: back in the LRU, most recent
        if self.use_storage and load_from < n:
            self._read_storage(lease, load_from)
        return lease

    def _swap_in(self, lease: Lease, host_pos: list[int], first_uncached: int, held: dict[str, int]) -> int:
        """Swap the host hits in; returns where storage may take over (after a failure, nowhere)."""
        if not host_pos:
            return first_uncached
        slots = [held[lease.hashes[i]] for i in host_pos]
        try:
            self.svc.swap_to_gpu([lease.gpu_blocks[i] for i in host_pos], slots,
                                 timeout=self.task_timeout).result(self.task_timeout + 10)
            self.stats.swap_in_blocks += len(host_pos)
            return first_uncached
        except Exception as exc:
            logger.warning("swap-in of %d blocks failed (%s): recomputing from block %d", len(host_pos), exc,
                           host_pos[0])
            self.stats.failed_loads += len(host_pos)
            for i in range(host_pos[0], len(lease.sources)):
                if lease.sources[i] == "host":
                    lease.sources[i] = "miss"
            return len(lease.sources)  # a hole in the prefix: nothing after it is worth loading

    def _read_storage(self, lease: Lease, start: int) -> None:
        gpu = lease.gpu_blocks[start:]
        try:
            loaded = self.svc.read_storage(lease.hashes, gpu, start_read_block_idx=start,
                                           timeout=self.task_timeout).result(self.task_timeout + 15)
        except Exception as exc:
            logger.warning("storage read failed (%s): recomputing", exc)
            self.stats.failed_loads += 1
            return
        if loaded != gpu[:len(loaded)]:
            logger.error("storage returned blocks %s for %s; recomputing", loaded[:4], gpu[:4])
            return
        for i in range(start, start + len(loaded)):
            lease.sources[i] = "storage"
            self._stored.add(lease.hashes[i])
        self.stats.storage_read_blocks += len(loaded)

    def commit(self, lease: Lease) -> None:
        """The request's blocks now hold their contents: make them findable."""
        for h, block in zip(lease.hashes, lease.gpu_blocks):
            if h not in self._dev_by_hash and block not in self._dev_hash:
                self._dev_by_hash[h] = block
                self._dev_hash[block] = h

    def release(self, lease: Lease) -> None:
        """Write the request's blocks through to storage and unpin them (after the write)."""
        if self.write_policy == "write_through" and self.use_storage and lease.hashes:
            new = [h for h in lease.hashes if h not in self._stored]
            if new:
                future = self.svc.write_storage(lease.hashes, lease.gpu_blocks, timeout=self.task_timeout)
                self._writes.append((future, list(lease.gpu_blocks), list(lease.hashes)))
                self.stats.storage_write_blocks += len(new)
                return
        for block in lease.gpu_blocks:
            self._unpin(block)

    def reap_writes(self, wait: bool = False) -> None:
        """Unpin the blocks of finished write-throughs (``wait``: of all of them)."""
        keep = []
        for future, blocks, hashes in self._writes:
            if wait or future.done():
                try:
                    stored = future.result(self.task_timeout + 15)
                    self._stored.update(hashes[:len(stored)])
                except Exception as exc:
                    logger.warning("write-through failed: %s", exc)
                for block in blocks:
                    self._unpin(block)
            else:
                keep.append((future, blocks, hashes))
        self._writes = keep

    def drain(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self._writes and time.monotonic() < deadline:
            self.reap_writes(wait=True)

    # ------------------------------------------------------------------ inspection
    def device_block_of(self, block_hash: str) -> int | None:
        return self._dev_by_hash.get(block_hash)

    def host_slot_of(self, block_hash: str) -> int | None:
        return self._host.get(block_hash)
