"""Read-storage and write-storage tasks of one CTM rank (DESIGN §3.1, §3.3, §3.7, §4).

One storage object is one block of one rank for all layers of one cache kind (K, V, or an
fp8 scale), keyed ``{namespace}/{block hash}/{rank}/{k|v|k_scale|v_scale}``.  Two ways to
move the bytes, chosen from what the platform and the backend say they can do:

* **direct**: the backend gathers/scatters a block's layers straight from/to the device
  caches (``batch_set_multi``/``batch_get_multi``): device-direct backends always, and
  host-staged backends with multi-buffer calls where device memory is host memory (CPU).
* **staged**: ``swap_cache_layout`` packs the blocks into a registered block-major staging
  buffer (sized for ``--max_model_len``) and the backend moves whole objects from there;
  read and write have separate buffers.

Writes are write-through and skip the leading blocks already stored.  Reads load the
leading run of blocks present and intact for every kind.  Every backend call runs on a
per-direction I/O thread and is waited for with the task's timeout: an error or a timeout
yields fewer (possibly 0) blocks, never a hang, and the CTM keeps serving swaps.  A staged
buffer is only ever touched by its own I/O thread, so a call that outlives its task cannot
mix its bytes into a later task; a direct call that times out switches the rank to the
staged path for good, since a late direct call would touch device blocks the engine has
moved on from.
"""
from __future__ import annotations

import logging
import math
import time
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

import ops
from ops.platform import Platform
from transfer_factory.keys import Namespace, storage_key
from transfer_factory.kvcache_storage import KVCacheStorage, StorageAccess

from .cache_tasks import ReadStorageTask, WriteStorageTask

KIND_TAGS = {"key_caches": "k", "value_caches": "v", "key_cache_scales": "k_scale", "value_cache_scales": "v_scale"}
TRANSFER_MODES = ("auto", "staged", "direct")


@dataclass
class _Group:
    """One cache kind: its per-layer tensors and, on the staged path, its staging buffers."""

    tag: str
    tensors: list[Any]
    block_bytes: int  # per layer
    layer_ptrs: list[int]
    read_staging: int = 0
    write_staging: int = 0
    read_plan: Any = None
    write_plan: Any = None

    @property
    def object_bytes(self) -> int:
        return self.block_bytes * len(self.tensors)


class StorageMover:
    def __init__(self, platform: Platform, backend: KVCacheStorage, groups: Sequence[tuple[str, list[Any]]],
                 namespace: Namespace, rank: int, max_blocks: int, transfer: str, log: logging.Logger):
        if transfer not in TRANSFER_MODES:
            raise ValueError(f"storage transfer mode {transfer!r} must be one of {TRANSFER_MODES}")
        self.platform = platform
        self.backend = backend
        self.namespace = namespace
        self.rank = rank
        self.max_blocks = max_blocks
        self.log = log
        self.groups: list[_Group] = []
        for kind, tensors in groups:
            t = tensors[0]
            block_bytes = int(np.prod(t.shape[1:])) * t.element_size()
            self.groups.append(_Group(KIND_TAGS[kind], tensors, block_bytes, [int(x.data_ptr()) for x in tensors]))
        self.device_blocks = min(int(t.shape[0]) for _, tensors in groups for t in tensors)  # valid in every layer
        can_direct = backend.access == StorageAccess.DEVICE_DIRECT or (
            backend.supports_multi_buffer and platform.host_addressable)
        if transfer == "direct" and not can_direct:
            raise ValueError(f"--storage_transfer direct needs a device-direct backend or multi-buffer calls on a "
                             f"host-addressable platform ({backend.name} on {platform.name} has neither)")
        self.direct = can_direct and transfer != "staged"
        self._io = {"read": _IOThread("storage-read-io"), "write": _IOThread("storage-write-io")}
        if self.direct and backend.access == StorageAccess.HOST_STAGED:
            for g in self.groups:
                for t in g.tensors:
                    backend.register_buffer(int(t.data_ptr()), int(np.prod(t.shape)) * t.element_size())
        self._staging_ready = False
        self._staging_registered = False
        self._staging_lock = threading.Lock()
        if not self.direct:
            self._prepare_staging()
            self._register_staging()
        log.info("storage: backend %s, %s path, namespace %s", backend.name, "direct" if self.direct else "staged",
                 namespace)

    def _fall_back_to_staging(self) -> None:
        """A direct call outlived its task: stage every later transfer.  The buffers are set up
        here, on the task's thread, never on an I/O thread that may still be stuck."""
        with self._staging_lock:
            if not self.direct:
                return
            try:
                self._prepare_staging()
            except Exception as exc:
                self.log.error("cannot set up staging buffers (%s): storage stays on the direct path", exc)
                return
            self.direct = False
        self.log.error("a direct storage call outlived its task: this rank now stages every transfer")

    def _prepare_staging(self) -> None:
        """Allocate the staging buffers and their copy plans (no backend call: it may be stuck)."""
        if self._staging_ready:
            return
        for g in self.groups:
            nbytes = self.max_blocks * g.object_bytes
            g.read_staging = self.platform.host_alloc(nbytes)
            g.write_staging = self.platform.host_alloc(nbytes)
            shape = list(g.tensors[0].shape)
            g.read_plan = self.platform.plan_layout(g.tensors, g.read_staging, shape)
            g.write_plan = self.platform.plan_layout(g.tensors, g.write_staging, shape)
        self._staging_ready = True

    def _register_staging(self) -> None:
        """Register the staging buffers with the backend, once; runs on an I/O thread."""
        with self._staging_lock:
            if self._staging_registered:
                return
            for g in self.groups:
                for ptr in (g.read_staging, g.write_staging):
                    self.backend.register_buffer(ptr, self.max_blocks * g.object_bytes)
            self._staging_registered = True

    # ------------------------------------------------------------------ helpers
    def _keys(self, g: _Group, hashes: Sequence[str]) -> list[str]:
        return [storage_key(self.namespace, h, self.rank, g.tag) for h in hashes]

    def _direct_batch(self, gpu_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per object (kind-major, then block): the address of the block in every layer's cache."""
        ptrs = [[base + gid * g.block_bytes for base in g.layer_ptrs] for g in self.groups for gid in gpu_ids]
        sizes = [[g.block_bytes] * len(g.layer_ptrs) for g in self.groups for _ in gpu_ids]
        return ptrs, sizes

    def _staged_batch(self, buffer: str, n: int) -> tuple[list[int], list[int]]:
        """Per object (kind-major, then block): its slot in the kind's staging buffer."""
        ptrs = [getattr(g, buffer) + j * g.object_bytes for g in self.groups for j in range(n)]
        return ptrs, [g.object_bytes for g in self.groups for _ in range(n)]

    def _call(self, direction: str, fn: Callable[[], Any], deadline: float, what: str) -> Any:
        """Run ``fn`` on the direction's I/O thread; None if it fails or outlives the deadline."""
        future = self._io[direction].submit(fn)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.log.error("storage %s timed out (%s)", what, self.backend.name)
            if self.direct:
                self._fall_back_to_staging()
            return None
        except Exception as exc:
            self.log.error("storage %s failed: %s: %s", what, type(exc).__name__, exc)
            return None

    def _present(self, hashes: Sequence[str], deadline: float, direction: str) -> int:
        """Leading blocks present for every kind (one batched call for all kinds)."""
        def count() -> int:
            found = self.backend.exists([k for g in self.groups for k in self._keys(g, hashes)])
            per_block = np.array(found, dtype=np.int64).reshape(len(self.groups), len(hashes)) == 1
            return _leading(per_block.all(axis=0).tolist())

        n = self._call(direction, count, deadline, "query")
        return int(n) if n is not None else 0

    @staticmethod
    def _check_ids(gpu_ids: Sequence[int], hashes: Sequence[str], what: str) -> None:
        if len(gpu_ids) != len(hashes):
            raise ValueError(f"{what}: {len(hashes)} keys but {len(gpu_ids)} gpu_block_ids")
        if len(set(gpu_ids)) != len(gpu_ids):
            raise ValueError(f"{what}: gpu_block_ids repeat a block")
        for h in hashes:
            if not h or "/" in h:
                raise ValueError(f"{what}: key {h!r} must be a non-empty block hash without '/'")

    # ------------------------------------------------------------------ write
    def write(self, task: WriteStorageTask) -> list[int]:
        """Store the blocks; returns the gpu ids of the leading run now stored."""
        deadline = time.monotonic() + task.timeout
        self._check_ids(task.gpu_block_ids, task.keys, "write")
        self._check_device_ids(task.gpu_block_ids)
        stored = self._present(task.keys, deadline, "write")
        total = stored
        for start in range(stored, len(task.keys), self.max_blocks):
            end = min(start + self.max_blocks, len(task.keys))
            ok = self._write_chunk(task.keys[start:end], task.gpu_block_ids[start:end], deadline)
            total += ok
            if ok < end - start:
                break
        return list(task.gpu_block_ids[:total])

    def _write_chunk(self, hashes: Sequence[str], gpu_ids: Sequence[int], deadline: float) -> int:
        direct = self.direct

        def job() -> list[bool]:
            # One batch for every kind: a backend call per kind would add a round trip each.
            keys = [k for g in self.groups for k in self._keys(g, hashes)]
            if direct:
                ptrs, sizes = self._direct_batch(gpu_ids)
                res = self.backend.batch_set_multi(keys, ptrs, sizes)
            else:
                self._register_staging()
                for g in self.groups:
                    self.platform.run_plan(g.write_plan, list(gpu_ids), list(range(len(gpu_ids))), ops.DEVICE_TO_HOST)
                ptrs, sizes = self._staged_batch("write_staging", len(gpu_ids))
                res = self.backend.batch_set(keys, ptrs, sizes)
            done = np.array([r == 0 for r in res], dtype=bool).reshape(len(self.groups), len(hashes))
            return done.all(axis=0).tolist()

        ok = self._call("write", job, deadline, f"write of {len(hashes)} blocks")
        return _leading(ok)

    # ------------------------------------------------------------------ read
    def read(self, task: ReadStorageTask) -> list[int]:
        """Load the leading run of present blocks; returns their gpu ids."""
        deadline = time.monotonic() + task.timeout
        if task.start_read_block_idx > len(task.keys):
            raise ValueError(f"start_read_block_idx {task.start_read_block_idx} is past the {len(task.keys)} keys")
        hashes = task.keys[task.start_read_block_idx:]
        self._check_ids(task.gpu_block_ids, hashes, "read")
        self._check_device_ids(task.gpu_block_ids)
        present = self._present(hashes, deadline, "read")
        loaded = 0
        for start in range(0, present, self.max_blocks):
            end = min(start + self.max_blocks, present)
            ok = self._read_chunk(hashes[start:end], task.gpu_block_ids[start:end], deadline)
            loaded += ok
            if ok < end - start:
                break
        return list(task.gpu_block_ids[:loaded])

    def _read_chunk(self, hashes: Sequence[str], gpu_ids: Sequence[int], deadline: float) -> int:
        direct = self.direct

        def job() -> list[bool]:
            keys = [k for g in self.groups for k in self._keys(g, hashes)]
            if direct:
                ptrs, sizes = self._direct_batch(gpu_ids)
                res = self.backend.batch_get_multi(keys, ptrs, sizes)
            else:
                self._register_staging()
                ptrs, sizes = self._staged_batch("read_staging", len(gpu_ids))
                res = self.backend.batch_get(keys, ptrs, sizes)
            want = np.repeat([g.object_bytes for g in self.groups], len(hashes))
            done = (np.array(res, dtype=np.int64) == want).reshape(len(self.groups), len(hashes))
            return done.all(axis=0).tolist()

        loaded = _leading(self._call("read", job, deadline, f"read of {len(hashes)} blocks"))
        if loaded and not direct:
            # Only after the I/O thread finished with the staging buffer, and only the good prefix.
            for g in self.groups:
                self.platform.run_plan(g.read_plan, list(gpu_ids[:loaded]), list(range(loaded)), ops.HOST_TO_DEVICE)
        return loaded

    def _check_device_ids(self, gpu_ids: Sequence[int]) -> None:
        limit = self.device_blocks
        for i, gid in enumerate(gpu_ids):
            if not 0 <= gid < limit:
                raise ValueError(f"device block id {gid} at position {i} is out of range [0, {limit})")

    def close(self, timeout: float = 5.0, close_backend: bool = True) -> None:
        """Stop the I/O threads and (unless told not to) close the backend, waiting at most
        ``timeout`` for each.  Staging buffers still held by a backend call that never
        returned are left to process exit."""
        idle = all(io.stop(timeout) for io in self._io.values())
        if idle:
            for g in self.groups:
                for ptr in (g.read_staging, g.write_staging):
                    if ptr:
                        self.platform.host_free(ptr)
        if not close_backend:
            return
        closer = threading.Thread(target=self.backend.close, name="storage-close", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            self.log.error("storage backend %s did not close within %.0fs", self.backend.name, timeout)


class _IOThread:
    """A single daemon worker: a backend call that never returns must not keep the process alive."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def stop(self, timeout: float) -> bool:
        """Ask the worker to finish; True if it did within ``timeout``."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _leading(ok: Sequence[bool] | None) -> int:
    if not ok:
        return 0
    n = 0
    for flag in ok:
        if not flag:
            break
        n += 1
    return n


def staging_blocks(max_model_len: int, block_size: int) -> int:
    return max(1, math.ceil(max_model_len / block_size))
