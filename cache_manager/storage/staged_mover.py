"""Read-storage and write-storage tasks of one CTM rank over an object store (DESIGN §3.1, §3.3,
§3.7, §3.8, §4): file, Mooncake.  Backends that move device blocks themselves (EMS,
AttentionStore) go through ``device_storage_mover.DeviceStorageMover`` instead.

One storage object is one block of one rank for all layers of one cache kind (K, V, or an
fp8 scale), keyed ``{namespace}/{block hash}/{rank}/{k|v|k_scale|v_scale}``.  Two ways to
move the bytes, chosen from what the platform and the backend say they can do:

* **staged** (the default for host-staged backends): a write packs the blocks into a
  registered block-major staging buffer on the task's thread, before the deadline, and the
  backend stores from there; a read has the backend fill a staging buffer and scatters it
  into the device blocks on the task's thread, only if the whole call succeeded before the
  deadline.  A backend call that outlives its task touches only its staging buffer, which
  stays out of use until the call returns: a late call can neither change a device block
  nor store bytes the engine wrote after the task.  A write call runs under the task's
  ``CommitLease`` (``write_leases``), revoked before the task answers; a backend that honours
  leases (the file store) then commits nothing.  A call that had begun committing, or whose
  backend cannot honour a lease (Mooncake's put is one call), may still store its objects
  after the answer, a deviation from DESIGN §3.8 with the snapshot's bytes only: the task
  answers at its deadline with the leading run stored before it (that chunk counts 0 blocks)
  and its device blocks released (``Outcome.still_storing``, not ``still_running``), so
  neither the engine's done signal nor a later task on those blocks waits for a frozen
  store; the rank still counts the call as a task in flight, so a drain or an RL clear waits
  for it before it closes the store or frees the caches.  A backend that reads by CPU copies
  (``staged_read_piece_bytes``, the file store), on a platform whose copies cannot stall,
  is read in pieces when a chunk spans several: the I/O thread reads a piece into the first
  staging slots and scatters it while it is still in the CPU cache, under a ``ScatterLease``
  that the task revokes before it answers, so nothing reaches a device block once the task
  has answered.
* **direct** (``--storage_transfer direct``, backends with multi-buffer calls): the backend
  gathers/scatters a block's layers straight from/to the device caches.  A direct call that
  outlives its task still touches device blocks, so the rank answers in time (0 blocks)
  with ``released=False`` and reports the release when the call returns; the engine keeps
  those blocks until then (two-phase completion).  Later transfers of the rank stage.

Writes are write-through and skip the leading blocks already stored.  Reads load the
leading run of blocks present and intact for every kind.  Every backend call runs on a
per-direction I/O thread with a bounded backlog; a call whose deadline passed before it
started is cancelled and never starts, and a full backlog or no free staging buffer
(``staging`` owns them) fails the chunk at once with a log line, so a stuck backend shows up as
failed tasks, never as memory growth or a hang.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

import ops
from ops.platform import Platform
from transfer_factory.keys import Namespace, storage_key
from transfer_factory.kvcache_storage import CommitLease, KVCacheStorage, StorageAccess, commit_lease

from cache_manager.cache_tasks import Outcome, ReadStorageTask, WriteStorageTask
from cache_manager.storage.io_threads import (IO_BACKLOG, ClosesOffThread, IOThread, ScatterLease, StorageBusy,
                         begin_task_stats,
                         check_block_ids, current_task_stats, leading, read_span, start_call,
                         wait_call)
from cache_manager.storage.staging import StagingBuffer, StagingBuffers
from cache_manager.storage.transfer_modes import resolve_transfer
from cache_manager.storage.write_leases import WriteLeases

STAGING_BUFFERS = 2  # per direction: one for the task at hand, one held by a call that outlived its task


@dataclass
class _Group:
    """One cache kind: its per-layer tensors."""

    tag: str
    tensors: list[Any]
    block_bytes: int  # per layer
    layer_ptrs: list[int]

    @property
    def object_bytes(self) -> int:
        return self.block_bytes * len(self.tensors)


@dataclass
class _Chunk:
    """What one chunk of a task achieved."""

    blocks: int = 0
    still_running: Future | None = None  # a direct call past the deadline: it still touches the blocks
    still_storing: Future | None = None  # a staged write past the deadline that may still commit (its snapshot)


class StorageMover(ClosesOffThread):
    def __init__(self, platform: Platform, backend: KVCacheStorage, groups: Sequence[tuple[str, list[Any]]],
                 namespace: Namespace, rank: int, max_blocks: int, transfer: str, log: logging.Logger,
                 staging_buffers: int = STAGING_BUFFERS, io_backlog: int = IO_BACKLOG):
        path = resolve_transfer(transfer, backend, platform)
        self.platform = platform
        self.backend = backend
        self.namespace = namespace
        self.rank = rank
        self.max_blocks = max_blocks
        self.log = log
        self.groups: list[_Group] = []
        for tag, tensors in groups:  # tag: the storage key's kind of the group (cache_layout)
            t = tensors[0]
            block_bytes = int(np.prod(t.shape[1:])) * t.element_size()
            self.groups.append(_Group(tag, tensors, block_bytes, [int(x.data_ptr()) for x in tensors]))
        self.device_blocks = min(int(t.shape[0]) for _, tensors in groups for t in tensors)  # valid in every layer
        if backend.access != StorageAccess.HOST_STAGED:
            raise ValueError(f"{backend.name} moves device blocks itself: it needs a DeviceStorageMover")
        self.direct = path == "direct"
        # A backend whose calls busy-wait (Mooncake) has its calling threads yield the CPU to the
        # threads that move the bytes (io_nice, see storage_io.IOThread).
        nice = int(getattr(backend, "io_nice", 0) or 0)
        self._io = {d: IOThread(f"storage-{d}-io", io_backlog, nice) for d in ("read", "write")}
        self._leases = WriteLeases(bool(getattr(backend, "honours_commit_lease", False)), backend.name, log)
        if self.direct:
            for g in self.groups:
                for t in g.tensors:
                    backend.register_buffer(int(t.data_ptr()), int(np.prod(t.shape)) * t.element_size())
        # Backends that copy through the CPU (the file store) read a staged chunk in pieces that
        # are scattered while still in cache; a backend whose every call is a round trip reads a
        # chunk in one call.
        piece = int(getattr(backend, "staged_read_piece_bytes", 0) or 0)
        self._piece_blocks = max(1, piece // self._block_bytes()) if piece and platform.copies_cannot_stall else 0
        self._staging = StagingBuffers(platform, backend, [g.tensors for g in self.groups],
                                       [g.object_bytes for g in self.groups], max_blocks, staging_buffers)
        if not self.direct:
            self._staging.prepare()
            self._staging.register_all()
        log.info("storage: backend %s, %s path, namespace %s", backend.name, "direct" if self.direct else "staged",
                 namespace)

    def _fall_back_to_staging(self) -> None:
        """A direct call outlived its task: stage every later transfer.  The buffers are set up
        here, on the task's thread, and registered by the I/O thread when it gets to them."""
        if not self.direct:
            return
        try:
            self._staging.prepare()
        except Exception as exc:
            self.log.error("cannot set up staging buffers (%s): storage stays on the direct path", exc)
            return
        self.direct = False
        self.log.error("a direct storage call outlived its task: this rank now stages every transfer")

    # ------------------------------------------------------------------ helpers
    def _all_keys(self, hashes: Sequence[str]) -> list[str]:
        """Block-major (every kind of block 0, then of block 1, ...): a store that fills up
        midway keeps whole leading blocks."""
        return [storage_key(self.namespace, h, self.rank, g.tag) for h in hashes for g in self.groups]

    def _direct_batch(self, gpu_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per object (block-major, then kind): the address of the block in every layer's cache."""
        ptrs = [[base + gid * g.block_bytes for base in g.layer_ptrs] for gid in gpu_ids for g in self.groups]
        sizes = [[g.block_bytes] * len(g.layer_ptrs) for _ in gpu_ids for g in self.groups]
        return ptrs, sizes

    def _staged_batch(self, buf: StagingBuffer, n: int) -> tuple[list[int], list[int]]:
        """Per object (block-major, then kind): its slot in the kind's staging buffer."""
        ptrs = [ptr + j * g.object_bytes for j in range(n) for g, ptr in zip(self.groups, buf.ptrs)]
        return ptrs, [g.object_bytes for _ in range(n) for g in self.groups]

    def _per_block(self, ok: Sequence[bool], n: int) -> list[bool]:
        return np.array(ok, dtype=bool).reshape(n, len(self.groups)).all(axis=1).tolist()

    def _start(self, direction: str, fn: Callable[[], Any], deadline: float, what: str) -> Future | None:
        return start_call(self._io[direction], fn, deadline, what, self.log)

    def _wait(self, future: Future, deadline: float, what: str) -> tuple[Any, bool]:
        return wait_call(future, deadline, what, self.backend.name, self.log)

    def _present(self, hashes: Sequence[str], deadline: float, direction: str) -> int:
        """Leading blocks present for every kind (one batched call for all kinds)."""
        def count() -> int:
            found = self.backend.exists(self._all_keys(hashes))
            return leading(self._per_block([f == 1 for f in found], len(hashes)))

        future = self._start(direction, count, deadline, "query")
        if future is None:
            return 0
        n, _ = self._wait(future, deadline, "query")
        return int(n) if n is not None else 0

    def _block_bytes(self) -> int:
        return sum(g.object_bytes for g in self.groups)

    # ------------------------------------------------------------------ write
    def write(self, task: WriteStorageTask, deadline: float | None = None) -> Outcome:
        """Store the blocks; the value is the gpu ids of the leading run now stored."""
        deadline = time.monotonic() + task.timeout if deadline is None else deadline
        stats = begin_task_stats()
        check_block_ids(task.gpu_block_ids, task.keys, self.device_blocks, "write")
        stored = self._present(task.keys, deadline, "write")
        total, written, chunk = stored, 0, _Chunk()
        for start in range(stored, len(task.keys), self.max_blocks):
            if time.monotonic() >= deadline:
                break
            end = min(start + self.max_blocks, len(task.keys))
            chunk = self._write_chunk(task.keys[start:end], task.gpu_block_ids[start:end], deadline)
            total += chunk.blocks
            written += chunk.blocks
            if chunk.blocks < end - start:
                break
        return Outcome(list(task.gpu_block_ids[:total]), written * self._block_bytes(), chunk.still_running,
                       stats.calls, stats.failures, still_storing=chunk.still_storing)

    def _write_chunk(self, hashes: Sequence[str], gpu_ids: Sequence[int], deadline: float) -> _Chunk:
        keys = self._all_keys(hashes)
        what = f"write of {len(hashes)} blocks"
        if self.direct:
            ptrs, sizes = self._direct_batch(gpu_ids)
            future = self._start("write", lambda: self.backend.batch_set_multi(keys, ptrs, sizes), deadline, what)
            return self._finish_direct(future, deadline, what, lambda res: [r == 0 for r in res], len(hashes))
        try:
            buf = self._staging.take("write")
        except StorageBusy as exc:
            self.log.error("storage %s not started: %s", what, exc)
            return _Chunk()
        try:
            # The snapshot is taken here, while the task is live; the I/O thread only reads it.
            for g, plan in zip(self.groups, buf.plans):
                self.platform.run_plan(plan, list(gpu_ids), list(range(len(gpu_ids))), ops.DEVICE_TO_HOST)
        except BaseException:
            self._staging.give_back("write", buf)
            raise
        ptrs, sizes = self._staged_batch(buf, len(gpu_ids))
        lease = CommitLease(deadline)

        def job() -> list[int]:
            self._staging.register(buf)
            with commit_lease(lease):
                return self.backend.batch_set(keys, ptrs, sizes)

        future = self._start("write", job, deadline, what)
        if future is None:
            self._staging.give_back("write", buf)
            return _Chunk()
        self._leases.track(lease, future)
        future.add_done_callback(lambda _f: self._staging.give_back("write", buf))  # also on cancel
        res, running = self._wait(future, deadline, what)
        if running:  # it reads only its own snapshot: the device blocks are free whatever it does
            return _Chunk(still_storing=self._leases.late(future, lease, what))
        if res is None:
            return _Chunk()
        return _Chunk(leading(self._per_block([r == 0 for r in res], len(hashes))))

    def _finish_direct(self, future: Future | None, deadline: float, what: str,
                       ok: Callable[[list[int]], list[bool]], n: int) -> _Chunk:
        if future is None:
            return _Chunk()
        res, running = self._wait(future, deadline, what)
        if running:
            self._fall_back_to_staging()
            return _Chunk(still_running=future)
        if res is None:
            return _Chunk()
        return _Chunk(leading(self._per_block(ok(res), n)))

    # ------------------------------------------------------------------ read
    def read(self, task: ReadStorageTask, deadline: float | None = None) -> Outcome:
        """Load the leading run of present blocks; the value is their gpu ids."""
        deadline = time.monotonic() + task.timeout if deadline is None else deadline
        stats = begin_task_stats()
        hashes = read_span(task.keys, task.start_read_block_idx)
        check_block_ids(task.gpu_block_ids, hashes, self.device_blocks, "read")
        # No exists() first: a get of an absent object is a miss as cheap as asking, and asking
        # cost every read one more backend round trip.  The first short chunk ends the read.
        loaded, late = 0, None
        for start in range(0, len(hashes), self.max_blocks):
            if time.monotonic() >= deadline:
                break
            end = min(start + self.max_blocks, len(hashes))
            chunk = self._read_chunk(hashes[start:end], task.gpu_block_ids[start:end], deadline)
            loaded += chunk.blocks
            late = chunk.still_running
            if chunk.blocks < end - start:
                break
        return Outcome(list(task.gpu_block_ids[:loaded]), loaded * self._block_bytes(), late, stats.calls,
                       stats.failures)

    def _read_chunk(self, hashes: Sequence[str], gpu_ids: Sequence[int], deadline: float) -> _Chunk:
        keys = self._all_keys(hashes)
        what = f"read of {len(hashes)} blocks"
        want = np.tile([g.object_bytes for g in self.groups], len(hashes))
        full = lambda res: (np.array(res, dtype=np.int64) == want).tolist()  # noqa: E731
        if self.direct:
            ptrs, sizes = self._direct_batch(gpu_ids)
            future = self._start("read", lambda: self.backend.batch_get_multi(keys, ptrs, sizes), deadline, what)
            return self._finish_direct(future, deadline, what, full, len(hashes))
        try:
            buf = self._staging.take("read")
        except StorageBusy as exc:
            self.log.error("storage %s not started: %s", what, exc)
            return _Chunk()
        if self._piece_blocks and len(gpu_ids) > self._piece_blocks:  # one piece would gain nothing
            return self._read_pieces(buf, keys, gpu_ids, deadline, what)
        ptrs, sizes = self._staged_batch(buf, len(gpu_ids))

        def job() -> list[int]:
            self._staging.register(buf)
            return self.backend.batch_get(keys, ptrs, sizes)

        future = self._start("read", job, deadline, what)
        if future is None:
            self._staging.give_back("read", buf)
            return _Chunk()
        res, running = self._wait(future, deadline, what)
        if running:  # the buffer comes back when the call does
            future.add_done_callback(lambda _f: self._staging.give_back("read", buf))
            return _Chunk()
        try:
            loaded = leading(self._per_block(full(res), len(hashes))) if res is not None else 0
            if loaded and time.monotonic() >= deadline:
                self.log.error("storage %s finished after its deadline: nothing scattered", what)
                loaded = 0
            if loaded:  # only the good prefix, only in time
                self._scatter(buf, gpu_ids[:loaded], range(loaded))
        finally:
            self._staging.give_back("read", buf)
        return _Chunk(loaded)

    def _scatter(self, buf: StagingBuffer, gpu_ids: Sequence[int], slots: Sequence[int], bulk: bool = False) -> None:
        for plan in buf.plans:
            self.platform.run_plan(plan, list(gpu_ids), list(slots), ops.HOST_TO_DEVICE, bulk=bulk)

    def _read_pieces(self, buf: StagingBuffer, keys: list[str], gpu_ids: Sequence[int], deadline: float,
                     what: str) -> _Chunk:
        """A staged read in pieces that stay in the CPU cache: the I/O thread reads a piece into
        the first slots of the staging buffer and scatters it at once, under a lease the task
        revokes before it answers.  The bytes then cross main memory once each way, as a raw
        read's do, instead of three times (read, checksum, scatter of the whole chunk).  Only
        on platforms whose copies cannot stall: revoking waits for a scatter in progress."""
        lease = ScatterLease(deadline)
        kinds, step = len(self.groups), self._piece_blocks
        ptrs, sizes = self._staged_batch(buf, min(step, len(gpu_ids)))

        def job() -> tuple[int, int]:
            self._staging.register(buf)
            loaded = calls = 0
            for start in range(0, len(gpu_ids), step):
                n = min(step, len(gpu_ids) - start)
                res = self.backend.batch_get(keys[start * kinds:(start + n) * kinds], ptrs[:n * kinds],
                                             sizes[:n * kinds])
                calls += 1
                good = leading(self._per_block([r == size for r, size in zip(res, sizes)], n))
                piece = gpu_ids[start:start + good]
                if good and not lease.run(lambda: self._scatter(buf, piece, range(len(piece)), bulk=True)):
                    break
                loaded += good
                if good < n:
                    break
            return loaded, calls

        future = self._start("read", job, deadline, what)
        if future is None:
            self._staging.give_back("read", buf)
            return _Chunk()
        res, running = self._wait(future, deadline, what)
        lease.revoke()  # from here on the job scatters nothing: the task may answer
        if running:
            future.add_done_callback(lambda _f: self._staging.give_back("read", buf))
            return _Chunk()
        self._staging.give_back("read", buf)
        if res is None:
            return _Chunk()
        loaded, calls = res
        current_task_stats().calls += calls - 1
        return _Chunk(loaded)

    # ------------------------------------------------------------------ close (ClosesOffThread)
    def _before_close(self) -> None:
        """A write call still running commits nothing from now on (the RL clear, the CTM's exit)."""
        self._leases.revoke_all()

    def _free_buffers(self) -> None:
        self._staging.free_all()                  # idempotent
