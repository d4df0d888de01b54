"""The engine's side of RL weight updates: ``clear_caches`` and ``restore_caches`` (DESIGN §3.9).

``clear_caches(svc)`` sets ``kv_cache_status`` to CLEARING and waits, bounded, until every rank
has drained its tasks, detached its caches and the status reads CLEARED; then the engine frees
its device caches.  A rank that dies meanwhile fails the clear at once (``CacheUpdateError``
naming it) instead of hanging it; restart it with ``restart_rank`` and clear again.

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
from cache_manager.kv_cache_lifecycle import key_prefix_from_version

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
            raise CacheUpdateError(f"{what} timed out after {timeout:g}s (kv_cache_status {status(svc).name}); "
                                   f"ranks not done: {behind}")
        time.sleep(_TICK)


def clear_caches(svc: "CacheTransferService", timeout: float = 60.0) -> None:
    current = status(svc)
    if current != KVCacheStatus.NORMAL:
        raise CacheUpdateError(f"clear_caches needs kv_cache_status NORMAL, it is {current.name}")
    t0 = time.monotonic()
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
    svc.caches = DeviceCaches(svc.platform, svc.spec, svc.tp, svc.device_ids)
    for rank in range(svc.tp):
        svc.caches.create_rank(rank)
    svc.signals[CACHE_READY_SIGNAL].value[:] = np.ones(svc.tp, np.int32)
    svc.signals[KV_CACHE_STATUS_SIGNAL].value[0] = int(KVCacheStatus.UPDATING)
    _wait(svc, KVCacheStatus.NORMAL, timeout, "restore_caches", CACHE_TRANSFER_INITED_SIGNAL)
    logger.info("[RL] caches restored on %d ranks in %.2fs (model version %r)", svc.tp, time.monotonic() - t0,
                svc.model_version)
