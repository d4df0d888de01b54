"""The staging buffers of a host-staged storage mover (``staged_mover``): per direction a few
block-major host buffers, one per cache kind, with their copy plans.

A buffer is taken for one chunk and given back when the backend call that uses it returns, even
a call that outlived its task: so a late call only ever touches its own buffer, and when every
buffer is held the next chunk fails at once (``StorageBusy``) instead of waiting."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from ops.platform import Platform
from transfer_factory.kvcache_storage import KVCacheStorage

from cache_manager.storage.io_threads import StorageBusy

DIRECTIONS = ("read", "write")


@dataclass(eq=False)
class StagingBuffer:
    """One staging buffer per cache kind (block-major) and its copy plans."""

    ptrs: list[int]
    plans: list[Any]
    registered: bool = False


class StagingBuffers:
    def __init__(self, platform: Platform, backend: KVCacheStorage, tensors_per_kind: Sequence[list[Any]],
                 object_bytes: Sequence[int], max_blocks: int, per_direction: int,
                 slots: Sequence[int] | None = None):
        """``slots``: per kind, its slots (default ``max_blocks``; a state group's object is one per
        task, in slot 0)."""
        self._platform = platform
        self._backend = backend
        self._tensors = list(tensors_per_kind)
        self._object_bytes = list(object_bytes)  # one block of one kind, all layers
        self._max_blocks = max_blocks
        self._slots = list(slots) if slots is not None else [max_blocks] * len(self._object_bytes)
        self._per_direction = per_direction
        self._free: dict[str, queue.SimpleQueue] = {d: queue.SimpleQueue() for d in DIRECTIONS}
        self._all: list[StagingBuffer] = []
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Allocate the buffers and their copy plans, once (no backend call: it may be stuck)."""
        with self._lock:
            if self._all:
                return
            for direction in DIRECTIONS:
                for _ in range(self._per_direction):
                    ptrs = [self._platform.host_alloc(n * size) for n, size in zip(self._slots, self._object_bytes)]
                    plans = [self._platform.plan_layout(tensors, ptr, list(tensors[0].shape))
                             for tensors, ptr in zip(self._tensors, ptrs)]
                    buf = StagingBuffer(ptrs, plans)
                    self._all.append(buf)
                    self._free[direction].put(buf)

    def register_all(self) -> None:
        for buf in list(self._all):
            self.register(buf)

    def register(self, buf: StagingBuffer) -> None:
        """Register ``buf`` with the backend, once (on the I/O thread when the path changed late)."""
        if not buf.registered:
            for n, size, ptr in zip(self._slots, self._object_bytes, buf.ptrs):
                self._backend.register_buffer(ptr, n * size)
            buf.registered = True

    def take(self, direction: str) -> StagingBuffer:
        try:
            return self._free[direction].get_nowait()
        except queue.Empty:
            raise StorageBusy(f"every {direction} staging buffer is held by a storage call that outlived its task "
                              f"({self._backend.name} is stuck)") from None

    def give_back(self, direction: str, buf: StagingBuffer) -> None:
        self._free[direction].put(buf)

    def free_all(self) -> None:
        """Free every buffer; only once no backend call can still use one."""
        with self._lock:
            for buf in self._all:
                for ptr in buf.ptrs:
                    self._platform.host_free(ptr)
            self._all.clear()
