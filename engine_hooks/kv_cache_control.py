"""The engine's side of RL weight updates: ``clear_caches`` and ``restore_caches`` (DESIGN §3.9).

``clear_caches(svc)`` sets ``kv_cache_status`` to CLEARING and waits, bounded, until every rank
has drained its tasks, detached its caches and the status reads CLEARED; then the engine frees
its device caches.  A rank that dies meanwhile fails the clear at once (``CacheUpdateError``
naming it) instead of hanging it; restart it with ``restart_rank`` and clear again.  A rank
whose task still has an I/O that may touch its blocks (one that outlived its deadline) keeps
its caches attached until that I/O ends, however long: the clear times out naming it, and the
engine's memory is not freed.  Calling ``clear_caches`` again goes on waiting; ``restart_rank``
ends the I/O with the process.

``restore_caches(svc)`` re-creates the device caches, sets ``cache_ready_signal`` for every rank,
re-reads the storage key prefix from ``<model_path>/version.yaml`` when storage is on, sets
UPDATING and waits, bounded, for NORMAL.  KV written under the old weights lives under the old
namespace and is never served again; the engine's prefix cache must forget its device and host
entries too (``TieredPrefixCache.forget_all()``).

While the status is not NORMAL, every task fails at once with ``CachesClearedError``.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from cache_manager.cache_data import (CACHE_READY_SIGNAL, CACHE_TRANSFER_INITED_SIGNAL, KV_CACHE_STATUS_SIGNAL,
                                      KVCacheStatus)
from cache_manager.cache_spec import key_prefix_from_version

from .device_caches import DeviceCaches
from .errors import CacheUpdateError

if TYPE_CHECKING:
    from .service import CacheTransferService

logger = logging.getLogger(__name__)
_TICK = 0.02


def status(svc: "CacheTransferService") -> KVCacheStatus:
    return KVCacheStatus(int(svc.signals[KV_CACHE_STATUS_SIGNAL].value[0]))


def _wait(svc: "CacheTransferService", want: KVCacheStatus, timeout: float, what: str, pending_signal: str) -> None:
    deadline = time.monotonic() + timeout
    while status(svc) != want:
        dead = [r for r, p in svc.procs.items() if not p.alive()]
        if dead:
            raise CacheUpdateError(f"{what} failed: rank(s) {dead} died ({svc.procs[dead[0]].describe_failure()})")
        if time.monotonic() > deadline:
            flags = svc.signals[pending_signal].value
            behind = [r for r in range(svc.tp) if (flags[r] != 0 if want == KVCacheStatus.CLEARED else flags[r] != 1)]
            hint = ("; a rank keeps its caches attached while a task's I/O may still touch them: call "
                    "clear_caches again to wait on, or restart_rank to end that I/O"
                    if want == KVCacheStatus.CLEARED else "")
            raise CacheUpdateError(f"{what} timed out after {timeout:g}s (kv_cache_status {status(svc).name}); "
                                   f"ranks not done: {behind}{hint}")
        time.sleep(_TICK)


def clear_caches(svc: "CacheTransferService", timeout: float = 60.0) -> None:
    current = status(svc)
    if current not in (KVCacheStatus.NORMAL, KVCacheStatus.CLEARING, KVCacheStatus.CLEARED):
        raise CacheUpdateError(f"clear_caches needs kv_cache_status NORMAL (or CLEARING or CLEARED, to finish a "
                               f"clear that timed out), it is {current.name}")
    t0 = time.monotonic()
    if current == KVCacheStatus.NORMAL:
        svc.signals[KV_CACHE_STATUS_SIGNAL].value[0] = int(KVCacheStatus.CLEARING)
    _wait(svc, KVCacheStatus.CLEARED, timeout, "clear_caches", CACHE_READY_SIGNAL)
    svc.caches.close()  # every rank has detached: the engine frees its KV memory
    logger.info("[RL] caches cleared on %d ranks in %.2fs", svc.tp, time.monotonic() - t0)


def restore_caches(svc: "CacheTransferService", timeout: float = 120.0) -> None:
    current = status(svc)
    if current != KVCacheStatus.CLEARED:
        raise CacheUpdateError(f"restore_caches needs kv_cache_status CLEARED, it is {current.name}")
    t0 = time.monotonic()
    if svc.storage_backend != "none":
        svc.model_version = key_prefix_from_version(svc.model_id)  # the namespace the ranks will use
    svc.caches.close()  # every rank is detached (CLEARED); a clear that timed out at its end left them
    svc.caches = DeviceCaches(svc.platform, svc.spec, svc.tp, svc.device_ids)
    for rank in range(svc.tp):
        svc.caches.create_rank(rank)
    svc.signals[CACHE_READY_SIGNAL].value[:] = np.ones(svc.tp, np.int32)
    svc.signals[KV_CACHE_STATUS_SIGNAL].value[0] = int(KVCacheStatus.UPDATING)
    _wait(svc, KVCacheStatus.NORMAL, timeout, "restore_caches", CACHE_TRANSFER_INITED_SIGNAL)
    logger.info("[RL] caches restored on %d ranks in %.2fs (model version %r)", svc.tp, time.monotonic() - t0,
                svc.model_version)
