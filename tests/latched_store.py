"""A latched backend for fault tests: a real FileStore whose chosen calls block until released.

Loaded by the CTM processes as a storage plugin
(``CTM_STORAGE_PLUGINS=latched=tests.latched_store:LatchedStore``).  The test process steers it
through files, since the calls run in other processes:

* ``<latch_dir>/<call>`` exists: every ``<call>`` (``batch_set``, ``batch_get``,
  ``batch_set_multi``, ``batch_get_multi``, ``exists``) blocks before touching any buffer;
* the call announces itself with ``<latch_dir>/<call>.entered.<rank>`` and, once it has
  returned from the real store, ``<latch_dir>/<call>.done.<rank>``;
* removing ``<latch_dir>/<call>`` releases it.  A latch holds at most ``MAX_LATCH_S``;
* a latch file holding a number N lets the first N calls of each rank through and blocks the
  rest (a read stuck after its first pieces).

The store reads in the inner FileStore's pieces (``staged_read_piece_bytes``), as the file
backend does.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

from transfer_factory.file.store import FileStore
from transfer_factory.kvcache_storage import KVCacheStorage

MAX_LATCH_S = 60.0
LATCHED_CALLS = ("exists", "batch_get", "batch_set", "batch_get_multi", "batch_set_multi")


class LatchedStore(KVCacheStorage):
    name = "latched"
    supports_multi_buffer = True
    honours_commit_lease = True  # the inner FileStore, called on the same thread, asks the CTM's lease

    def __init__(self, *, namespace: str, rank: int, options: Mapping[str, Any] | None = None):
        options = dict(options or {})
        self.latch_dir = options.pop("latch_dir")
        self.rank = rank
        self.inner = FileStore(namespace=namespace, rank=rank, options=options)
        self.staged_read_piece_bytes = self.inner.staged_read_piece_bytes
        self._passed: dict[str, int] = {}  # per call: calls let through by a numbered latch

    def _gate(self, call: str) -> None:
        latch = os.path.join(self.latch_dir, call)
        try:
            with open(latch) as f:
                allowed = f.read().strip()
        except FileNotFoundError:
            self._passed.pop(call, None)
            return
        if allowed:
            self._passed[call] = self._passed.get(call, 0) + 1
            if self._passed[call] <= int(allowed):
                return
        open(f"{latch}.entered.{self.rank}", "w").close()
        deadline = time.monotonic() + MAX_LATCH_S
        while os.path.exists(latch) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _done(self, call: str) -> None:
        open(os.path.join(self.latch_dir, f"{call}.done.{self.rank}"), "w").close()

    def _call(self, call: str, *args: Any) -> list[int]:
        self._gate(call)
        try:
            return getattr(self.inner, call)(*args)
        finally:
            self._done(call)

    def register_buffer(self, ptr: int, size: int) -> None:
        self.inner.register_buffer(ptr, size)

    def exists(self, keys: Sequence[str]) -> list[int]:
        return self._call("exists", keys)

    def batch_get(self, keys, ptrs, sizes) -> list[int]:
        return self._call("batch_get", keys, ptrs, sizes)

    def batch_set(self, keys, ptrs, sizes) -> list[int]:
        return self._call("batch_set", keys, ptrs, sizes)

    def batch_get_multi(self, keys, ptr_lists, size_lists) -> list[int]:
        return self._call("batch_get_multi", keys, ptr_lists, size_lists)

    def batch_set_multi(self, keys, ptr_lists, size_lists) -> list[int]:
        return self._call("batch_set_multi", keys, ptr_lists, size_lists)

    def delete(self, keys: Sequence[str]) -> list[int]:
        return self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.inner.close()
