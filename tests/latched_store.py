"""A latched backend for fault tests: a real FileStore whose chosen calls block until released.

Loaded by the CTM processes as a storage plugin
(``CTM_STORAGE_PLUGINS=latched=tests.latched_store:LatchedStore``).  The test process steers it
through files, since the calls run in other processes:

* ``<latch_dir>/<call>`` exists: every ``<call>`` (``batch_set``, ``batch_get``,
  ``batch_set_multi``, ``batch_get_multi``, ``exists``) blocks before touching any buffer;
* the call announces itself with ``<latch_dir>/<call>.entered.<rank>`` and, once it has
  returned from the real store, ``<latch_dir>/<call>.done.<rank>``;
* removing ``<latch_dir>/<call>`` releases it.  A latch holds at most ``MAX_LATCH_S``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

from transfer_factory.file_store import FileStore
from transfer_factory.kvcache_storage import KVCacheStorage

MAX_LATCH_S = 60.0
LATCHED_CALLS = ("exists", "batch_get", "batch_set", "batch_get_multi", "batch_set_multi")


class LatchedStore(KVCacheStorage):
    name = "latched"
    supports_multi_buffer = True

    def __init__(self, *, namespace: str, rank: int, options: Mapping[str, Any] | None = None):
        options = dict(options or {})
        self.latch_dir = options.pop("latch_dir")
        self.rank = rank
        self.inner = FileStore(namespace=namespace, rank=rank, options=options)

    def _gate(self, call: str) -> None:
        latch = os.path.join(self.latch_dir, call)
        if not os.path.exists(latch):
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
